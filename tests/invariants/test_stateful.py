"""The ledger's invariants, checked by search (DESIGN.md §11).

A Hypothesis state machine drives the real ledger code — Submitter, DeliveryWorker, the
operator commands as `smtpguard resolve|release|queue retry|queue drop` apply them — on two
instances sharing one real store (a SQLite file; a real redis-server), relaying to a real
recording upstream that answers each event as scripted (250, 4xx or 5xx at MAIL, RCPT or the
dot, a drop at the DATA command, a drop after the dot). Steps: submissions (same or another
message under a key; keyed or derived), time passing, an instance killed at an exact phase
(kill -9: it writes nothing more, its connections close, its leases expire as time passes,
a fresh process takes its place), an instance stalled at a phase while time passes and the
other instance acts, reloads (relay ⇄ queue, a class renamed or removed, caps and windows
changed), operator decisions, store errors (before the write, after it with the reply lost,
and on Redis a connection reset between a script and its reply) and delivery-worker passes.

After every step:
 1. Once: the upstream took at most one copy per (zone, key) and event; derive_window only
    replaces delivered, expired or relay-deferred records; a key held unknown or failed is
    not sent again until an operator acts.
 2. Nothing stranded: every key whose client got a 250 is delivered, unknown, failed,
    expired, or waiting in a lane with a queue entry that comes due; at the end of each run
    time passes with every instance's worker running, and then nothing may still wait.
 3. Units: the cap units consumed lie between the messages whose final dot reached the
    upstream and the DATA commands it saw, plus reservations still in flight before DATA
    and attempts killed after noting data_sent (whose unit nobody can know about).
 4. Own writes: no submission loses a lease that nobody else took.
 6. Errors before DATA: an event is `unknown` only if its final dot went out, or its
    instance was killed after noting data_sent.
 7. Provider events (§13, §18; tests/support/stateful_events.py): a bounce arrives at any moment
    relative to its send — before it, held after the data_sent note or after the final dot
    with the 250 not yet written, after the outcome, for a key never sent — through the
    record's provider or another: in flight it is retry-later and stores nothing; it is
    applied once, to its own zone's record only; a stranger is never suppressed.
 8. Verdicts (§19; tests/support/stateful_verdicts.py): the provider's log settles a record at
    any moment with any verdict it could truthfully give; only an `unknown` record changes,
    never while an owner that lost its lease may still be in DATA for `not accepted`, and
    invariant 1 holds through it: never two upstream acceptances of one event.

Runs with the `ci` profile by default; scripts/stateful runs the `long` one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import redis.asyncio as aioredis
import yaml
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from smtpguard.config import Config, loads, provider_secrets
from smtpguard.delivery import DeliveryWorker
from smtpguard.policy import ledger
from smtpguard.policy.fingerprint import fingerprint
from smtpguard.policy.ledger import Phase, Record, State
from smtpguard.policy.limits import month_of
from smtpguard.policy.message import HeaderLimits, parse
from smtpguard.policy.queue import queue_due
from smtpguard.relay import Route, build_providers
from smtpguard.replies import Reply
from smtpguard.server import Server
from smtpguard.store import QueueEntry, Store, StoreUnavailable, store_from_url
from smtpguard.submission import Principal, Result, Submitter
from tests.support import RedisServer, free_port
from tests.support.hypothesis_profiles import stateful_settings
from tests.support.postgres import PostgresServer, reset
from tests.support.stateful import (
    BEHAVIOURS,
    Clock,
    Fault,
    Gate,
    HalfRandom,
    ScriptedUpstream,
    StoreGate,
    StoreProxy,
    Txn,
    WireFaults,
    end_tasks_of,
    install_task_owners,
    is_data_sent_mark,
    spawn_as,
)
from tests.support.stateful_events import STRANGER, EventModel, deliver_and_check
from tests.support.stateful_verdicts import KINDS as VERDICT_KINDS
from tests.support.stateful_verdicts import apply_verdict, truthful

T = TypeVar("T")

HOSTNAME = "guard.test"
ACTOR = "stateful@operator"
RCPTS = ("customer@example.com",)
ZONES = ("acme", "auto")
START = 1_900_000_000.0  # 2030-03-17: no month boundary within a run's few days
PASS_BUDGET = 20.0
"""Real seconds a worker pass may take to come quiet: a pass that never does is a hang."""
STALLED_PASS_BUDGET = 3 * PASS_BUDGET + 5.0
"""A pass stalled at a phase (stall_during_delivery) is held there by the harness while the
other instance runs a whole pass of its own: its budget covers reaching the phase (20 s at
most), the stalled writes landing (5 s) and that other pass (PASS_BUDGET), on top of its own.
With PASS_BUDGET alone, a PostgreSQL long run on a loaded machine timed out such a pass."""


# --- the events --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Msg:
    """One submission's message. acme keys its events (X-Event-Key k1..k3; body 1 is a
    different message under the same key); auto derives them (missing_key: derive), so each
    body is its own event. Every event has its own envelope sender, by which the upstream
    tells the events apart."""

    zone: str
    label: str
    body: int = 0

    @property
    def sender(self) -> str:
        return f"{self.label}@notify.{self.zone}.example"

    def raw(self, cls: str | None) -> bytes:
        lines = [f"From: {self.sender}", f"To: {RCPTS[0]}", f"Subject: Event {self.label}"]
        if self.zone == "acme":
            lines.append(f"X-Event-Key: {self.label}")
        if cls is not None:
            lines.append(f"X-Message-Class: {cls}")
        lines += ["", f"Event {self.label}, version {self.body}.", ""]
        return "\r\n".join(lines).encode()

    @functools.cached_property
    def key(self) -> str:
        if self.zone == "acme":
            return self.label
        parsed = parse(self.raw(None), HeaderLimits(64 * 1024, 500))
        assert not isinstance(parsed, Reply)
        return "auto:" + fingerprint(self.sender, RCPTS, parsed)


MESSAGES = [
    Msg("acme", "k1"),
    Msg("acme", "k1", 1),
    Msg("acme", "k2"),
    Msg("acme", "k2", 1),
    Msg("acme", "k3"),
    Msg("auto", "b0"),
    Msg("auto", "b1"),
    Msg("auto", "b2"),
]
EVENTS: dict[tuple[str, str], Msg] = {}
UNIT_TOKEN_KEPT = 2 * 3600.0
"""How long both stores keep a cap token where a refund finds it (their hourly window)."""
for _m in MESSAGES:
    EVENTS.setdefault((_m.zone, _m.key), _m)
SENDERS = {m.sender: (m.zone, m.key) for m in MESSAGES}


# --- configs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One config, as a reload may switch to it."""

    acme: str = "relay"
    auto: str = "relay"
    classes: str = "base"
    caps: str = "tiny"
    windows: str = "long"


CLASSES = {
    "base": {
        "otp": {"max_age": "30s", "priority": 0},
        "transactional": {"max_age": "2h", "priority": 1},
        "bulk": {"max_age": "20m", "priority": 2},
    },
    "renamed": {
        "urgent": {"max_age": "30s", "priority": 0},
        "transactional": {"max_age": "2h", "priority": 1},
        "bulk": {"max_age": "20m", "priority": 2},
    },
    "removed": {
        "otp": {"max_age": "30s", "priority": 0},
        "transactional": {"max_age": "2h", "priority": 1},
    },
}
CAPS = {
    "tiny": {"acme": (3, 1000), "auto": (1000, 4)},
    "roomy": {"acme": (1000, 1000), "auto": (1000, 1000)},
}
WINDOWS = {  # lease, min_retry_interval, derive_window (seconds)
    "short": (3, 2, 4),
    "long": (6, 10, 30),
}
ADVANCES = (1.0, 4.0, 7.0, 31.0, 3 * 3600.0)
SETUPS = st.builds(
    Setup,
    acme=st.sampled_from(["relay", "queue"]),
    auto=st.sampled_from(["relay", "queue"]),
    classes=st.sampled_from(list(CLASSES)),
    caps=st.sampled_from(list(CAPS)),
    windows=st.sampled_from(list(WINDOWS)),
)


@functools.cache
def config_for(setup: Setup, upstream_port: int, store_url: str) -> Config:
    lease, retry, derive = WINDOWS[setup.windows]

    def zone(name: str, delivery: str, missing_key: str) -> dict[str, Any]:
        hourly, monthly = CAPS[setup.caps][name]
        z: dict[str, Any] = {
            "plan": "business",
            "hourly_cap": hourly,
            "monthly_cap": monthly,
            "missing_key": missing_key,
            "delivery": delivery,
            "senders": [f"@notify.{name}.example"],
        }
        if missing_key == "derive":
            z["derive_window"] = f"{derive}s"
        return z

    cfg = {
        "listen": [{"address": "127.0.0.1:0", "tls": "none"}],
        "store": {"url": store_url},
        # inflight_wait 0: a submission that meets a live lease answers 451 at once (the
        # clock only moves between steps, so a wait would never end).
        "event_key": {
            "inflight_wait": "0s",
            "min_retry_interval": f"{retry}s",
            "lease": f"{lease}s",
            "retention": "5d",
        },
        "providers": [
            {
                "name": "primary",
                "kind": "smtp",
                "host": "127.0.0.1",
                "port": upstream_port,
                "tls": "none",
                "timeouts": {"connect": "2s", "command": "5s", "data": "3s"},
                "pool_size": 4,
            }
        ],
        "breaker": {"failure_threshold": 3, "cooldown": "5s"},
        # One delivery at a time per worker: a crash during a pass hits one known delivery.
        "queue": {
            "backoff": {"base": "2s", "max": "8s"},
            "workers": 1,
            "poll_interval": "10ms",
            "default_class": "transactional",
            "classes": CLASSES[setup.classes],
        },
        "hostname": HOSTNAME,
        "log": {"format": "json", "level": "warning"},
        "zones": {
            "acme": zone("acme", setup.acme, "reject"),
            "auto": zone("auto", setup.auto, "derive"),
        },
    }
    return loads(yaml.safe_dump(cfg, sort_keys=False))


# --- the stores ------------------------------------------------------------------------------------
class SqliteBackend:
    name = "sqlite"
    fault_modes = ("before", "after")

    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "ledger.db"
        self.url = f"sqlite:///{self.path}"

    async def begin(self) -> None:
        self.end()

    async def open(self, wired: bool) -> tuple[Store, WireFaults | None]:
        store = store_from_url(self.url)
        await store.open()
        return store, None

    def end(self) -> None:
        """Every example starts from no file (each of its stores is closed by now)."""
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)


async def _patiently(read: Callable[[], Awaitable[T]]) -> T:
    """The harness's own read of the store (straight to it, past every injected fault). One
    that misses the store's 2 s deadline says the machine did not run this process in time
    (the Redis long profile, run beside the other two, once did), not that an invariant
    broke: it is read again. A store that stays away still fails the run."""
    for _ in range(3):
        try:
            return await read()
        except StoreUnavailable:
            await asyncio.sleep(0.5)
    return await read()


class RedisBackend:
    name = "redis"
    fault_modes = ("before", "after", "wire")

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.url = server.url

    async def begin(self) -> None:
        client = aioredis.Redis(host="127.0.0.1", port=self.server.port)
        try:
            await client.flushall()
        finally:
            await client.aclose()

    async def open(self, wired: bool) -> tuple[Store, WireFaults | None]:
        if not wired:
            store = store_from_url(self.url)
            await store.open()
            return store, None
        wire = WireFaults(self.server.port)
        await wire.start()
        store = store_from_url(f"redis://127.0.0.1:{wire.port}/0")
        await store.open()
        return store, wire

    def end(self) -> None:
        return None


class PostgresBackend:
    name = "postgres"
    fault_modes = ("before", "after")

    def __init__(self, server: PostgresServer) -> None:
        self.url = server.url

    async def begin(self) -> None:
        store = store_from_url(self.url)
        await store.open()  # the schema, so that there are tables to empty
        await store.close()
        await asyncio.to_thread(reset, self.url)

    async def open(self, wired: bool) -> tuple[Store, WireFaults | None]:
        store = store_from_url(self.url)
        await store.open()
        return store, None

    def end(self) -> None:
        return None


Backend = SqliteBackend | RedisBackend | PostgresBackend


class Harness:
    """What lives for one test: an event loop, the upstream, the backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.runner = asyncio.Runner()
        install_task_owners(self.runner.get_loop())
        self.upstream = ScriptedUpstream(free_port(), SENDERS)
        self.run(self.upstream.start())

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(timeout):
                return await coro

        return self.runner.run(bounded())

    def close(self) -> None:
        try:
            self.run(self.upstream.stop())
        finally:
            self.runner.close()


# --- one smtpguard instance --------------------------------------------------------------------
@dataclass
class Instance:
    slot: str
    name: str
    store: Store
    wire: WireFaults | None
    proxy: StoreProxy
    route: Route
    submitter: Submitter
    shell: Server
    has_worker: bool = False

    @property
    def helo(self) -> str:
        return f"{self.name}.helo.test"


@dataclass
class Model:
    """What the machine knows beyond the store: who was told 250, what may be sent."""

    got250: set[tuple[str, str]] = field(default_factory=set)
    step250: set[tuple[str, str]] = field(default_factory=set)
    allowed: dict[tuple[str, str], int] = field(default_factory=dict)
    """Accepted copies allowed per key: one per event the key named (derive_window)."""
    generation_from: dict[tuple[str, str], int] = field(default_factory=dict)
    """Upstream transaction index where the key's current event began."""
    snap: dict[tuple[str, str], Record | None] = field(default_factory=dict)
    held: dict[tuple[str, str], int] = field(default_factory=dict)
    """Keys held unknown or failed → their transaction count when they became held."""
    operated: set[tuple[str, str]] = field(default_factory=set)
    uncertain: dict[str, int] = field(default_factory=dict)
    """Per zone: units of attempts that died after noting data_sent but before DATA."""
    unrefunded: dict[str, str] = field(default_factory=dict)
    """Cap token → zone of refunds the store never got (StoreProxy.unrefunded, shared by
    every instance): the unit stays consumed by design."""
    unknown_ok: dict[tuple[str, str], int] = field(default_factory=dict)
    """Keys whose instance died after noting data_sent with no dot sent, and the key's
    transaction count then: `unknown` without a dot is what a crash there leaves."""
    txn_mark: int = 0
    months: set[str] = field(default_factory=set)
    overlapped: bool = False
    """This step ran two instances' work at once (a stall): a record may have passed
    through several states within it."""


def _marks_failure(fn: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapper(self: LedgerMachine, *args: Any, **kwargs: Any) -> T:
        try:
            return fn(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return wrapper


SLOTS = st.sampled_from(["a", "b"])
MSGS = st.sampled_from(MESSAGES)
CLASS_HEADERS = st.sampled_from([None, "otp", "bulk", "urgent"])
BEHAVIOUR_NAMES = st.sampled_from(list(BEHAVIOURS))
SUBMIT_PHASES = st.sampled_from(["reserved", "before_mark", "after_mark", "mail", "after_dot"])
WORKER_PHASES = st.sampled_from(
    ["claimed", "taken", "consumed", "before_mark", "after_mark", "mail", "after_dot"]
)
STALLS = st.sampled_from([1.0, 7.0, 31.0])
EVENT_MOMENTS = st.sampled_from(["now", "after_mark", "after_dot"])
THEN = st.sampled_from(["resubmit", "other_worker"])
OPERATOR_ACTIONS = st.sampled_from(
    ["resolve_delivered", "resolve_retry", "release", "queue_retry", "queue_drop"]
)
FAULT_METHODS = st.sampled_from(
    ["reserve", "put", "enqueue", "requeue", "claim", "consume_cap", "refund", "get"]
)


class LedgerMachine(RuleBasedStateMachine):
    harness: ClassVar[Harness]

    def __init__(self) -> None:
        super().__init__()
        self.h = type(self).harness
        self.up = self.h.upstream
        self.broken = False
        self.ready = False
        self.clock = Clock(START)
        self.model = Model()
        self.instances: dict[str, Instance] = {}
        self.generation = {"a": 0, "b": 0}
        self.configs: dict[str, Config] = {}
        self.direct: Store | None = None
        self.events = EventModel()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.h.run(coro)

    def run_as(self, inst: Instance, coro: Coroutine[Any, Any, T]) -> T:
        """Run instance code as that instance's own task (a crash ends all of them)."""

        async def owned() -> T:
            result: T = await spawn_as(inst.name, coro)
            return result

        return self.run(owned())

    # --- lifecycle ---------------------------------------------------------------------
    @initialize(setup=SETUPS)
    @_marks_failure
    def start(self, setup: Setup) -> None:
        self.run(self._start(setup))
        self.ready = True

    async def _start(self, setup: Setup) -> None:
        self.up.handler.reset()
        self.up.abort()
        await self.h.backend.begin()
        self.direct, _ = await self.h.backend.open(wired=False)
        self.model.months.add(month_of(self.clock()))
        for slot in ("a", "b"):
            self.configs[slot] = self._config(setup)
            self.instances[slot] = await self._instance(slot)

    def _config(self, setup: Setup) -> Config:
        return config_for(setup, self.up.port, self.h.backend.url)

    async def _instance(self, slot: str) -> Instance:
        """A fresh process: its own store connection, route, caches and worker."""
        config = self.configs[slot]
        name = f"{slot}{self.generation[slot]}"
        store, wire = await self.h.backend.open(wired=True)
        proxy = StoreProxy(store, self.clock, wire, self.model.unrefunded)
        helo = f"{name}.helo.test"
        route = Route(
            build_providers(config.providers, provider_secrets(config), helo),
            config.breaker.failure_threshold,
            config.breaker.cooldown,
            self.clock,
        )
        submitter = Submitter(config, proxy, route, name, HOSTNAME, self.clock)  # type: ignore[arg-type]
        shell = Server(config, clock=self.clock)
        shell.store = proxy  # type: ignore[assignment]
        shell.submitter = submitter
        shell.route = route
        inst = Instance(slot, name, store, wire, proxy, route, submitter, shell)
        await self._ensure_worker(inst)
        return inst

    async def _ensure_worker(self, inst: Instance) -> None:
        """Whether this instance runs a delivery worker is the server's decision (at start
        and at every reload); the machine then runs that worker in passes."""
        made = inst.shell._ensure_worker()
        if inspect.isawaitable(made):
            await made
        if inst.shell.worker is not None and not inst.has_worker:
            inst.has_worker = True
            await inst.shell.worker.stop(1.0)

    async def _dispose(self, inst: Instance) -> None:
        await end_tasks_of(inst.name)
        with contextlib.suppress(Exception):
            await inst.route.close()
        await inst.store.close()
        if inst.wire is not None:
            await inst.wire.close()

    def teardown(self) -> None:
        try:
            if self.ready and not self.broken:
                self.run(self._settle())
                self._check(final=True)
        finally:
            self.run(self._close())

    async def _close(self) -> None:
        for inst in self.instances.values():
            inst.proxy.dead = True
        self.up.abort()
        for inst in self.instances.values():
            await self._dispose(inst)
        if self.direct is not None:
            await self.direct.close()
        self.h.backend.end()

    async def _settle(self) -> None:
        """The end of a run: the provider works again, time passes, every instance's worker
        (where the server runs one) delivers what is due."""
        for inst in self.instances.values():
            inst.proxy.faults.clear()
            inst.proxy.gates.clear()
        self.up.handler.behaviours.clear()
        self.up.handler.gates.clear()
        # Past every lease, claim and lost owner's send time (connect + MAIL/RCPT/RSET + DATA).
        step = max(c.event_key.lease for c in self.configs.values()) + 2 + 3 * 5 + 3 + 10.0
        for advance in (step, step, 3600.0, 3600.0):
            self.clock.advance(advance)
            self.model.months.add(month_of(self.clock()))
            for inst in self.instances.values():
                if inst.has_worker:
                    await self._collect(inst, await spawn_as(inst.name, self._worker_pass(inst)))

    # --- steps ------------------------------------------------------------------------------------
    @rule(slot=SLOTS, msg=MSGS, cls=CLASS_HEADERS, behaviour=BEHAVIOUR_NAMES)
    @_marks_failure
    def submit(self, slot: str, msg: Msg, cls: str | None, behaviour: str) -> None:
        """A client submits; the provider answers this event's transactions with `behaviour`."""
        self.up.handler.behaviours[msg.sender] = behaviour
        inst = self.instances[slot]
        result = self.run_as(inst, self._submit(inst, msg, cls))
        self._client_result(inst, msg, result)

    async def _submit(self, inst: Instance, msg: Msg, cls: str | None) -> Result:
        principal = Principal(msg.zone, f"{msg.zone}-app")
        return await inst.submitter.submit(principal, msg.sender, list(RCPTS), msg.raw(cls))

    def _client_result(self, inst: Instance, msg: Msg, result: Result) -> None:
        note(f"{inst.name} submit {msg.zone}/{msg.label}: {result.reply} [{result.decision}]")
        if result.reply.code == 250:
            self.model.step250.add((msg.zone, msg.key))
        self.run(self._check_lease_lost(inst, msg.zone, msg.key, result))

    async def _check_lease_lost(self, inst: Instance, zone: str, key: str | None, result: Result) -> None:
        if result.decision != "lease_lost" or key is None:
            return
        direct = self.direct
        assert direct is not None
        rec = await _patiently(lambda: direct.get(zone, key))
        # DESIGN.md §11.4: a lease is lost only to another attempt that took the key over.
        assert not (rec is not None and rec.state is State.IN_FLIGHT and rec.owner == inst.name), (
            f"§11.4 own writes: {inst.name} lost the lease of {zone}/{key} that nobody else took "
            f"(record: {_brief(rec)}; injected store faults: {inst.proxy.injected})"
        )

    @rule(seconds=st.sampled_from(ADVANCES))
    @_marks_failure
    def time_passes(self, seconds: float) -> None:
        if seconds >= UNIT_TOKEN_KEPT:
            self.run(self._units_beyond_refund())
        self.clock.advance(seconds)
        self.model.months.add(month_of(self.clock()))

    async def _units_beyond_refund(self) -> None:
        """A known limit, stated in docs/runbook.md: a cap token stays findable for refunds
        only while the hourly window keeps it (2 h). An attempt abandoned before DATA and
        taken over later than that gets no monthly unit back, so the month may count one
        unit more than the provider saw DATA commands: allowed here, not hidden."""
        direct = self.direct
        assert direct is not None
        for zone, key in EVENTS:
            rec = await _patiently(lambda zone=zone, key=key: direct.get(zone, key))
            if rec is not None and rec.state is State.IN_FLIGHT and rec.phase is Phase.BEFORE_DATA:
                self.model.uncertain[zone] = self.model.uncertain.get(zone, 0) + 1

    @rule(slot=SLOTS, behaviour=st.none() | BEHAVIOUR_NAMES)
    @_marks_failure
    def worker_pass(self, slot: str, behaviour: str | None) -> None:
        """The instance's worker delivers what is due now (every event answered as
        `behaviour` when given)."""
        if behaviour is not None:
            for m in MESSAGES:
                self.up.handler.behaviours[m.sender] = behaviour
        inst = self.instances[slot]
        if not inst.has_worker:
            note(f"{inst.name} runs no worker")
            return
        results = self.run_as(inst, self._worker_pass(inst))
        self.run(self._collect(inst, results))

    async def _worker_pass(self, inst: Instance, budget: float = PASS_BUDGET) -> list[tuple[str, Result]]:
        """The real worker loop, from its first claim until a claim made with no delivery in
        progress finds nothing due, within `budget` seconds of real time."""
        results: list[tuple[str, Result]] = []
        worker = DeliveryWorker(
            inst.submitter, inst.proxy, lambda z, r: results.append((z, r)), rng=HalfRandom()
        )  # type: ignore[arg-type]
        quiet = asyncio.Event()

        def seen(idle: bool, n: int) -> None:
            if idle and n == 0:
                quiet.set()

        inst.proxy.claim_probe = lambda: not worker._active
        inst.proxy.claim_seen = seen
        worker.start()
        try:
            await asyncio.wait_for(quiet.wait(), budget)
        finally:
            inst.proxy.claim_probe = None
            inst.proxy.claim_seen = None
            await worker.stop(5)
        return results

    async def _collect(self, inst: Instance, results: list[tuple[str, Result]]) -> None:
        for zone, result in results:
            note(f"{inst.name} worker {zone}/{result.key}: {result.reply} [{result.decision}]")
            await self._check_lease_lost(inst, zone, result.key, result)

    @rule(slot=SLOTS, msg=MSGS, cls=CLASS_HEADERS, phase=SUBMIT_PHASES)
    @_marks_failure
    def crash_during_submit(self, slot: str, msg: Msg, cls: str | None, phase: str) -> None:
        """kill -9 of the instance when this submission reaches `phase` (if it does)."""
        inst = self.instances[slot]
        outcome = self.run(self._crash_during(inst, phase, lambda: self._submit(inst, msg, cls)))
        if isinstance(outcome, Result):
            self._client_result(inst, msg, outcome)
        else:
            note(f"{inst.name} killed at {phase} submitting {msg.zone}/{msg.label}")

    @rule(slot=SLOTS, phase=WORKER_PHASES)
    @_marks_failure
    def crash_during_delivery(self, slot: str, phase: str) -> None:
        """kill -9 of the instance when its worker's delivery reaches `phase` (if one does)."""
        inst = self.instances[slot]
        if not inst.has_worker:
            return
        outcome = self.run(self._crash_during(inst, phase, lambda: self._worker_pass(inst)))
        if isinstance(outcome, list):
            self.run(self._collect(inst, outcome))
        else:
            note(f"{inst.name} killed at {phase} delivering")

    @rule(slot=SLOTS, msg=MSGS, cls=CLASS_HEADERS, phase=SUBMIT_PHASES, seconds=STALLS, then=THEN)
    @_marks_failure
    def stall_during_submit(
        self, slot: str, msg: Msg, cls: str | None, phase: str, seconds: float, then: str
    ) -> None:
        """The instance stalls at `phase` of this submission (a long GC pause, a slow disk)
        while time passes and the other instance takes a client retry of the same message or
        runs its worker; then it carries on as if nothing happened."""
        inst = self.instances[slot]
        other = self.instances["b" if slot == "a" else "a"]
        mine, theirs = self.run(
            self._stall(inst, other, phase, seconds, lambda: self._submit(inst, msg, cls), then, msg, cls)
        )
        self._stall_results(inst, other, msg, mine, theirs)

    @rule(slot=SLOTS, phase=WORKER_PHASES, seconds=STALLS, then=THEN)
    @_marks_failure
    def stall_during_delivery(self, slot: str, phase: str, seconds: float, then: str) -> None:
        """As stall_during_submit, for a delivery of the instance's worker."""
        inst = self.instances[slot]
        if not inst.has_worker:
            return
        other = self.instances["b" if slot == "a" else "a"]
        msg = MESSAGES[0]
        mine, theirs = self.run(
            self._stall(
                inst,
                other,
                phase,
                seconds,
                lambda: self._worker_pass(inst, STALLED_PASS_BUDGET),
                then,
                msg,
                None,
            )
        )
        self._stall_results(inst, other, msg, mine, theirs)

    async def _stall(
        self,
        inst: Instance,
        other: Instance,
        phase: str,
        seconds: float,
        operation: Callable[[], Coroutine[Any, Any, Any]],
        then: str,
        msg: Msg,
        cls: str | None,
    ) -> tuple[Any, Any]:
        gate, disarm = self._arm(inst, phase)
        task = spawn_as(inst.name, operation())
        reached = asyncio.ensure_future(gate.reached.wait())
        done, _ = await asyncio.wait({task, reached}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise RuntimeError(f"{inst.name}: the operation neither reached {phase} nor ended")
        if not gate.reached.is_set():
            reached.cancel()
            disarm()
            return task.result(), None
        self.model.overlapped = True
        # What the stalled instance had already handed to the store lands first.
        async with asyncio.timeout(5):
            await inst.proxy.answered()
        self.clock.advance(seconds)
        self.model.months.add(month_of(self.clock()))
        if then == "resubmit":
            theirs: Any = await spawn_as(other.name, self._submit(other, msg, cls))
        elif other.has_worker:
            theirs = await spawn_as(other.name, self._worker_pass(other))
        else:
            theirs = None
        gate.release.set()
        async with asyncio.timeout(20):
            return await task, theirs

    def _stall_results(self, inst: Instance, other: Instance, msg: Msg, mine: Any, theirs: Any) -> None:
        for who, outcome in ((inst, mine), (other, theirs)):
            if isinstance(outcome, Result):
                self._client_result(who, msg, outcome)
            elif isinstance(outcome, list):
                self.run(self._collect(who, outcome))

    @rule(
        slot=SLOTS,
        msg=MSGS,
        when=EVENT_MOMENTS,
        to=st.sampled_from([RCPTS[0], STRANGER]),
        via=st.sampled_from(["primary", "elsewhere"]),
        again=st.booleans(),
    )
    @_marks_failure
    def provider_event(self, slot: str, msg: Msg, when: str, to: str, via: str, again: bool) -> None:
        """A provider's bounce for this event arrives `now`, or while a submission of it is
        held after its data_sent note or after the final dot (its 250 not yet written);
        tests/support/stateful_events.py says what must hold (DESIGN.md §18)."""
        inst = self.instances[slot]
        if when == "now":
            note(self.run(self._provider_event(msg, to, via, again)))
            return
        result = self.run(self._event_while_held(inst, msg, when, to, via, again))
        self._client_result(inst, msg, result)

    async def _provider_event(self, msg: Msg, to: str, via: str, again: bool) -> str:
        assert self.direct is not None
        line = await deliver_and_check(
            self.direct, self.events, ZONES, msg.zone, msg.key, to, via, self.clock(), again
        )
        for inst in self.instances.values():
            inst.submitter.suppressions.invalidate(msg.zone)
        return line

    async def _event_while_held(
        self, inst: Instance, msg: Msg, phase: str, to: str, via: str, again: bool
    ) -> Result:
        gate, disarm = self._arm(inst, phase)
        task = spawn_as(inst.name, self._submit(inst, msg, None))
        reached = asyncio.ensure_future(gate.reached.wait())
        done, _ = await asyncio.wait({task, reached}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise RuntimeError(f"{inst.name}: the submission neither reached {phase} nor ended")
        if gate.reached.is_set():
            async with asyncio.timeout(5):
                await inst.proxy.answered()
            note(f"held at {phase}: " + await self._provider_event(msg, to, via, again))
            gate.release.set()
        else:
            reached.cancel()
            disarm()
            note(await self._provider_event(msg, to, via, again))
        async with asyncio.timeout(20):
            result: Result = await task
        return result

    @rule(slot=SLOTS)
    @_marks_failure
    def crash_idle(self, slot: str) -> None:
        inst = self.instances[slot]
        self.run(self._kill(inst, len(self.up.txns)))

    async def _crash_during(
        self, inst: Instance, phase: str, operation: Callable[[], Coroutine[Any, Any, Any]]
    ) -> Any:
        gate, disarm = self._arm(inst, phase)
        mark = len(self.up.txns)
        task = spawn_as(inst.name, operation())
        reached = asyncio.ensure_future(gate.reached.wait())
        done, _ = await asyncio.wait({task, reached}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise RuntimeError(f"{inst.name}: the operation neither reached {phase} nor ended")
        if gate.reached.is_set():
            await self._kill(inst, mark)
            return "killed"
        reached.cancel()
        disarm()
        return task.result()

    def _arm(self, inst: Instance, phase: str) -> tuple[Gate, Callable[[], None]]:
        if phase in ("mail", "after_dot"):
            gate = Gate()
            self.up.handler.gates[(inst.helo, phase)] = gate
            return gate, lambda: self.up.handler.gates.pop((inst.helo, phase), None)
        name = inst.name
        gates = {
            # After the reservation (or queue acceptance) call is answered, before the relay.
            "reserved": StoreGate(("reserve", "enqueue"), "after"),
            "before_mark": StoreGate(("put",), "before", is_data_sent_mark),
            "after_mark": StoreGate(("put",), "after", is_data_sent_mark),
            "claimed": StoreGate(("claim",), "after", result_matches=bool),
            "taken": StoreGate(
                ("put",),
                "after",
                lambda _, args: (
                    isinstance(args[0], Record)
                    and args[0].state is State.IN_FLIGHT
                    and args[0].phase is Phase.BEFORE_DATA
                    and args[0].owner == name
                ),
            ),
            "consumed": StoreGate(("consume_cap",), "after"),
        }
        sg = gates[phase]
        inst.proxy.gates.append(sg)

        def disarm() -> None:
            if sg in inst.proxy.gates:
                inst.proxy.gates.remove(sg)

        return sg.gate, disarm

    async def _kill(self, inst: Instance, mark: int) -> None:
        """kill -9: what the store was already handed lands; nothing more is written, its
        connections close, its tasks end. A fresh process takes the slot."""
        async with asyncio.timeout(5):
            await inst.proxy.answered()
        inst.proxy.dead = True
        self.up.abort(inst.helo)
        await self._dispose(inst)
        assert self.direct is not None
        for (zone, key), _ in EVENTS.items():
            rec = await self.direct.get(zone, key)
            if rec is None or rec.state is not State.IN_FLIGHT or rec.owner != inst.name:
                continue
            if rec.phase is Phase.DATA_SENT:
                mine = [t for t in self.up.txns[mark:] if t.helo == inst.helo and t.key == key]
                if not mine or not mine[-1].dot:
                    self.model.uncertain[zone] = self.model.uncertain.get(zone, 0) + 1
                    self.model.unknown_ok[(zone, key)] = len(self._txns(zone, key))
        self.generation[inst.slot] += 1
        self.instances[inst.slot] = await self._instance(inst.slot)
        note(f"{inst.name} killed; {self.instances[inst.slot].name} started")

    @rule(which=st.sampled_from(["a", "b", "both"]), setup=SETUPS)
    @_marks_failure
    def reload(self, which: str, setup: Setup) -> None:
        """SIGHUP with a new config, as Server.reload applies it."""
        for slot in ("a", "b") if which == "both" else (which,):
            config = self._config(setup)
            self.configs[slot] = config
            inst = self.instances[slot]
            inst.submitter.config = config
            inst.shell.config = config
            self.run(self._ensure_worker(inst))

    @rule(action=OPERATOR_ACTIONS, msg=MSGS)
    @_marks_failure
    def operator(self, action: str, msg: Msg) -> None:
        """An operator command, applied as cli.py applies it. The operator is careful: they
        resolve as retry, or release, only after the provider says it has no copy."""
        zone, key = msg.zone, msg.key
        if action in ("resolve_retry", "release") and self._provider_has_copy(zone, key):
            if action == "release":
                note(f"operator: provider has {zone}/{key}; not released")
                return
            action = "resolve_delivered"
        changes: dict[str, Callable[[Record, float], Record]] = {
            "resolve_delivered": lambda r, now: ledger.resolve(r, "delivered", ACTOR, now),
            "resolve_retry": lambda r, now: ledger.resolve(r, "retry", ACTOR, now),
            "release": lambda r, now: ledger.release(r, ACTOR, now),
            "queue_retry": lambda r, now: ledger.retry_now(r, ACTOR, now),
            "queue_drop": lambda r, now: ledger.drop(r, ACTOR, now),
        }
        outcome = self.run(self._operator_change(zone, key, changes[action]))
        note(f"operator {action} {zone}/{key}: {outcome}")
        if outcome.startswith("now "):
            self.model.operated.add((zone, key))

    async def _operator_change(self, zone: str, key: str, change: Callable[[Record, float], Record]) -> str:
        """cli._operator_change: read, decide, compare-and-swap (with the queue entry)."""
        store = self.direct
        assert store is not None
        for _ in range(10):
            rec = await store.get(zone, key)
            if rec is None:
                return "no record"
            try:
                new = change(rec, self.clock())
            except ledger.OperatorRefused as e:
                return f"refused: {e}"
            if rec.lane is not None:
                written = await store.requeue(new, rec.version, queue_due(new))
            else:
                written = await store.put(new, rec.version)
            if written is None:
                return f"now {new.state.value}"
        return "kept changing"

    # --- verdicts (§19; tests/support/stateful_verdicts.py) ---------------------------------
    @rule(msg=MSGS, drawn=st.sampled_from(VERDICT_KINDS))
    @_marks_failure
    def verdict(self, msg: Msg, drawn: str) -> None:
        """The provider's log settles the event's record, at any moment, as truthfully as a
        log can: never `not accepted` while the provider holds a copy."""
        zone, key = msg.zone, msg.key
        kind = truthful(drawn, self._provider_has_copy(zone, key))
        store = self.direct
        assert store is not None
        interval = self.configs["a"].event_key.min_retry_interval
        brief, changed = self.run(apply_verdict(store, zone, key, kind, self.clock, interval))
        note(brief)
        if changed:
            self.model.operated.add((zone, key))

    # --- observation -------------------------------------------------------------------------
    def _txns(self, zone: str, key: str) -> list[Txn]:
        return [t for t in self.up.txns if t.zone == zone and t.key == key]

    def _provider_has_copy(self, zone: str, key: str) -> bool:
        start = self.model.generation_from.get((zone, key), 0)
        return any(t.accepted for t in self._txns(zone, key) if t.seq >= start)

    async def _observe(
        self,
    ) -> tuple[dict[tuple[str, str], Record | None], dict[str, list[QueueEntry]], dict[str, int]]:
        return await _patiently(self._read_state)

    async def _read_state(
        self,
    ) -> tuple[dict[tuple[str, str], Record | None], dict[str, list[QueueEntry]], dict[str, int]]:
        store = self.direct
        assert store is not None
        records = {k: await store.get(*k) for k in EVENTS}
        entries = {z: await store.queue_entries(z) for z in ZONES}
        used: dict[str, int] = {}
        for z in ZONES:
            used[z] = 0
            for month in sorted(self.model.months):
                used[z] += (await store.cap_usage(z, self.clock(), month)).month
        return records, entries, used

    @invariant()
    @_marks_failure
    def ledger_invariants(self) -> None:
        if self.ready:
            self._check(final=False)

    def _check(self, final: bool) -> None:
        records, entries, used = self.run(self._observe())
        m = self.model
        unknown_txns = [t for t in self.up.txns if t.key is None]
        assert not unknown_txns, f"harness: the upstream saw senders it cannot attribute: {unknown_txns}"

        for k, rec in records.items():
            prev = m.snap.get(k)
            if rec is not None and prev is None and k not in m.allowed:
                m.allowed[k] = 1
                m.generation_from[k] = m.txn_mark
            if prev is not None and rec is not None and rec.created_at != prev.created_at:
                # A new event under the same (derived) key.
                # Within a step that overlapped two instances the record may have become
                # delivered (replaceable) before the new event took it; what was held unknown
                # or failed at the step's start cannot have been released within it.
                replaceable = (
                    prev.state in (State.DELIVERED, State.EXPIRED)
                    or (prev.state is State.DEFERRED and prev.lane is None)
                    or (m.overlapped and prev.state not in (State.UNKNOWN, State.FAILED))
                )
                assert replaceable, (
                    f"§11.1 once: a new submission replaced {k[0]}/{k[1]} while it was "
                    f"{prev.state.value}{' in lane ' + str(prev.lane) if prev.lane else ''} "
                    f"(now {_brief(rec)})"
                )
                m.allowed[k] = m.allowed.get(k, 1) + 1
                m.generation_from[k] = m.txn_mark
                if k not in m.step250:
                    m.got250.discard(k)
                m.held.pop(k, None)
            if prev is not None and rec is None:
                assert k not in m.got250 and k not in m.step250, (
                    f"§11.2 stranded: the record of {k[0]}/{k[1]}, answered 250, is gone"
                )
        m.got250 |= m.step250

        for k in records:
            copies = [t for t in self._txns(*k) if t.accepted]
            assert len(copies) <= m.allowed.get(k, 1), (
                f"§11.1 once: the provider took {len(copies)} copies of {k[0]}/{k[1]} "
                f"(events under this key: {m.allowed.get(k, 1)}; record {_brief(records[k])}; "
                f"transactions {copies})"
            )

        for k, rec in records.items():
            sent = len(self._txns(*k))
            if k in m.held:
                assert sent == m.held[k] or k in m.operated, (
                    f"§11.1 held: {k[0]}/{k[1]} was sent again while held unknown/failed, "
                    f"with no operator decision (record {_brief(rec)})"
                )
            held_now = rec is not None and rec.state in (State.UNKNOWN, State.FAILED)
            if held_now and k not in m.held:
                m.held[k] = sent
            elif not held_now and k in m.held:
                assert k in m.operated, (
                    f"§11.1 held: {k[0]}/{k[1]} left unknown/failed with no operator decision "
                    f"(now {_brief(rec)})"
                )
                del m.held[k]

            prev = m.snap.get(k)
            newly_unknown = (
                rec is not None
                and rec.state is State.UNKNOWN
                and (prev is None or prev.state is not State.UNKNOWN or prev.created_at != rec.created_at)
            )
            if newly_unknown:
                txns = self._txns(*k)
                # The dot that matters is the one of the instance that recorded the unknown
                # outcome: another instance's later transaction (one that lost the lease and
                # stopped before DATA) says nothing about it.
                by = next((a.instance for a in reversed(rec.attempts) if a.outcome == "unknown"), None)
                mine = [t for t in txns if by is not None and t.helo.split(".")[0] == by]
                dot = any(t.dot for t in mine) if mine else bool(txns) and txns[-1].dot
                assert dot or m.unknown_ok.get(k) == len(txns), (
                    f"§11.6 errors before DATA: {k[0]}/{k[1]} is unknown although its final dot "
                    f"never went out (last transaction: {txns[-1] if txns else None}; record "
                    f"{_brief(rec)})"
                )

        for k in m.got250:
            rec = records[k]
            zone_entries = {e.key: e for e in entries[k[0]]}
            settled = rec is not None and rec.state in (
                State.DELIVERED,
                State.UNKNOWN,
                State.FAILED,
                State.EXPIRED,
            )
            if final:
                assert settled, (
                    f"§11.2 stranded: {k[0]}/{k[1]} was answered 250, and after time passed "
                    f"with every instance's worker running it is still {_brief(rec)} "
                    f"(queue entry: {zone_entries.get(k[1])})"
                )
                continue
            if settled:
                continue
            entry = zone_entries.get(k[1])
            assert (
                rec is not None and rec.lane is not None and entry is not None and entry.due_at is not None
            ), (
                f"§11.2 stranded: {k[0]}/{k[1]} was answered 250 but is {_brief(rec)} with "
                f"queue entry {entry}: no worker will deliver it"
            )

        for z in ZONES:
            txns = [t for t in self.up.txns if t.zone == z]
            dots = sum(t.dot for t in txns)
            commands = sum(t.data_command for t in txns)
            pending = sum(
                1
                for (zone, _), r in records.items()
                if zone == z and r is not None and r.state is State.IN_FLIGHT and r.phase is Phase.BEFORE_DATA
            )
            uncertain = m.uncertain.get(z, 0)
            kept = sum(1 for zone in m.unrefunded.values() if zone == z)
            assert dots <= used[z], (
                f"§11.3 units: zone {z} has {used[z]} units consumed but {dots} messages reached "
                "the provider's final dot (a unit was refunded for a message that went out)"
            )
            assert used[z] <= commands + pending + uncertain + kept, (
                f"§11.3 units: zone {z} has {used[z]} units consumed, but the provider saw "
                f"{commands} DATA commands; {pending} reservations are still before DATA and "
                f"{uncertain} attempts died after noting data_sent and {kept} refunds never "
                "reached the store (a unit of an attempt that never reached DATA was kept)"
            )

        m.snap = records
        m.overlapped = False
        m.step250 = set()
        m.operated = set()
        m.txn_mark = len(self.up.txns)


def _brief(rec: Record | None) -> str:
    if rec is None:
        return "no record"
    bits = [rec.state.value]
    if rec.lane is not None:
        bits.append(f"lane={rec.lane}")
    if rec.phase is not None:
        bits.append(f"phase={rec.phase.value}")
    if rec.owner is not None:
        bits.append(f"owner={rec.owner}")
    bits.append(f"attempts={[(a.instance, a.phase, a.outcome, a.code) for a in rec.attempts]}")
    return " ".join(bits)


def machine_for(h: Harness) -> type[LedgerMachine]:
    class Bound(LedgerMachine):
        harness = h

        @rule(slot=SLOTS, method=FAULT_METHODS, mode=st.sampled_from(h.backend.fault_modes))
        @_marks_failure
        def store_fault(self, slot: str, method: str, mode: str) -> None:
            """The instance's next `method` call fails: before it is sent (nothing written),
            after its write (the reply lost), or with the connection reset between the two
            (Redis: the client may run the script again)."""
            self.instances[slot].proxy.faults.append(Fault(method, mode))

    Bound.__name__ = f"LedgerMachine_{h.backend.name}"
    return Bound


def _run(backend: Backend, share: int = 1) -> None:
    """`share`: run 1/share of the profile's examples (a backend whose examples cost more)."""
    harness = Harness(backend)
    chosen = stateful_settings()
    if share > 1:
        chosen = settings(chosen, max_examples=max(10, chosen.max_examples // share))
    try:
        run_state_machine_as_test(machine_for(harness), settings=chosen)
    finally:
        harness.close()


def test_ledger_invariants_sqlite(tmp_path: Path) -> None:
    _run(SqliteBackend(tmp_path))


def test_ledger_invariants_redis(redis_server: RedisServer) -> None:
    _run(RedisBackend(redis_server))


def test_ledger_invariants_postgres(postgres_server: PostgresServer) -> None:
    # Each example opens every instance's pool and empties the tables: a third of the
    # examples keeps its cost near the other backends' (scripts/stateful searches further).
    _run(PostgresBackend(postgres_server), share=3)
