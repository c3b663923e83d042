"""Real parts for the stateful ledger test (tests/invariants/test_stateful.py, DESIGN.md §11).

Nothing here stands in for smtpguard: the upstream is an aiosmtpd server on a free port that
answers each event as scripted and records every transaction; the stores are real (a SQLite
file, a redis-server); the store proxy forwards every call and only adds what a test cannot
cause otherwise — a process that dies at an exact instant (kill -9: it writes nothing more),
a reply lost after its write, a connection reset between a Redis command and its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from smtpguard.policy.ledger import Phase, Record, State
from smtpguard.store import StoreUnavailable

# --- time --------------------------------------------------------------------------------------


class Clock:
    """The one clock of a run. Every place smtpguard takes a clock gets this one (the
    Submitter, its Route, the delivery worker through the Submitter, the operator commands,
    and `now()` of every store proxy), so "time passes" and "a lease expires" are steps that
    move it, never sleeps. Each reading moves it on by a few microseconds, as a real clock
    moves while a step runs: two readings are never the same instant."""

    TICK = 1e-5

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += self.TICK
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class HalfRandom(random.Random):
    """Jitter and lane draws fixed at the middle, so a replayed sequence delivers the same."""

    def random(self) -> float:
        return 0.5


# --- which simulated process a task belongs to ---------------------------------------------------

OWNER: contextvars.ContextVar[str | None] = contextvars.ContextVar("stateful_owner", default=None)
_OWNERS: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()


def install_task_owners(loop: asyncio.AbstractEventLoop) -> None:
    """Tag every task with the instance whose code created it, so a crash can end all of
    that instance's work (relays, lease renewals, worker deliveries) and nothing else."""

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
    ) -> asyncio.Task[Any]:
        context = kwargs.get("context")
        owner = context.get(OWNER) if context is not None else OWNER.get()
        task = asyncio.Task(coro, loop=loop, **kwargs)
        if owner is not None:
            _OWNERS[task] = owner
        return task

    loop.set_task_factory(factory)  # type: ignore[arg-type]


def spawn_as(owner: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    context = contextvars.copy_context()
    context.run(OWNER.set, owner)
    return asyncio.get_running_loop().create_task(coro, context=context)


def tasks_of(owner: str) -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if _OWNERS.get(t) == owner and not t.done()]


async def end_tasks_of(owner: str) -> None:
    """Cancel everything the owner runs, until nothing is left (cancelled code may start
    cleanup that a dead store proxy then hangs: that is cancelled too)."""
    for _ in range(20):
        pending = tasks_of(owner)
        if not pending:
            return
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.5)
    raise RuntimeError(f"tasks of {owner} would not end: {tasks_of(owner)}")


async def _forever() -> None:
    await asyncio.Event().wait()


# --- the recording upstream --------------------------------------------------------------------


@dataclass(frozen=True)
class Behaviour:
    """How the provider answers one event's transactions (the default accepts)."""

    mail: str | None = None
    rcpt: str | None = None
    data: str | None = None
    drop_before_data: bool = False
    """Close the connection when the DATA command arrives, before 354: nothing was sent."""
    drop_after_dot: bool = False
    """Take the message, then close without a reply (RFC 1047: the outcome is unknown)."""


BEHAVIOURS: dict[str, Behaviour] = {
    "ok": Behaviour(),
    "mail_451": Behaviour(mail="451 4.3.0 mail from: try later"),
    "mail_550": Behaviour(mail="550 5.7.1 sender refused"),
    "rcpt_452": Behaviour(rcpt="452 4.2.2 mailbox full"),
    "data_451": Behaviour(data="451 4.3.0 message: try later"),
    "data_554": Behaviour(data="554 5.6.0 message refused"),
    "drop_before_data": Behaviour(drop_before_data=True),
    "drop_after_dot": Behaviour(drop_after_dot=True),
}


@dataclass
class Txn:
    """One MAIL transaction as the provider saw it."""

    seq: int
    helo: str
    sender: str
    zone: str | None
    key: str | None
    behaviour: str
    data_command: bool = False
    """The DATA command arrived (the attempt went past RCPT)."""
    dot: bool = False
    """The whole message and its final dot arrived."""
    accepted: bool = False
    """The provider took the message: answered 250, or was about to (dropped or killed
    after the dot) — a copy that may reach the recipient."""
    message_id: str | None = None


class Gate:
    """Holds one operation at one point until released (or its connection dies)."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def hit(self) -> None:
        self.reached.set()
        await self.release.wait()


class ScriptedHandler:
    def __init__(self, senders: dict[str, tuple[str, str]]) -> None:
        self.senders = senders
        """Envelope sender → (zone, key): every event has its own sender address."""
        self.txns: list[Txn] = []
        self.behaviours: dict[str, str] = {}
        """Envelope sender → behaviour name; absent: "ok"."""
        self.gates: dict[tuple[str, str], Gate] = {}
        """(helo, "mail" | "after_dot") → a gate for that instance's next transaction."""

    def reset(self) -> None:
        self.txns.clear()
        self.behaviours.clear()
        self.gates.clear()

    def _txn(self, envelope: Envelope) -> Txn | None:
        txn: Txn | None = getattr(envelope, "_stateful_txn", None)
        return txn

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        zone, key = self.senders.get(address.lower(), (None, None))
        name = self.behaviours.get(address.lower(), "ok")
        txn = Txn(len(self.txns), str(session.host_name), address, zone, key, name)
        self.txns.append(txn)
        envelope._stateful_txn = None  # type: ignore[attr-defined]
        gate = self.gates.pop((txn.helo, "mail"), None)
        if gate is not None:
            await gate.hit()
        b = BEHAVIOURS[name]
        if b.mail:
            return b.mail
        envelope._stateful_txn = txn  # type: ignore[attr-defined]
        envelope.mail_from = address
        return "250 2.1.0 OK"

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        txn = self._txn(envelope)
        if txn is not None and BEHAVIOURS[txn.behaviour].rcpt:
            return str(BEHAVIOURS[txn.behaviour].rcpt)
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        txn = self._txn(envelope)
        assert txn is not None, "DATA without a transaction"
        txn.dot = True
        txn.message_id = _header(envelope.original_content or b"", "Message-ID")
        b = BEHAVIOURS[txn.behaviour]
        if b.data:
            return b.data
        txn.accepted = True
        gate = self.gates.pop((txn.helo, "after_dot"), None)
        if gate is not None:
            await gate.hit()
        if b.drop_after_dot:
            assert server.transport is not None
            server.transport.abort()
            return "250 2.0.0 never seen"
        return f"250 2.0.0 Ok: queued as Q{txn.seq}"


def _header(content: bytes, name: str) -> str | None:
    head = content.split(b"\r\n\r\n", 1)[0].decode(errors="replace")
    for line in head.split("\r\n"):
        k, _, v = line.partition(":")
        if k.strip().lower() == name.lower():
            return v.strip()
    return None


class _UpstreamSMTP(SMTP):
    live: set[_UpstreamSMTP]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.live.add(self)

    def connection_lost(self, error: Exception | None) -> None:
        self.live.discard(self)
        super().connection_lost(error)

    async def smtp_DATA(self, arg: str) -> None:
        handler = self.event_handler
        txn = handler._txn(self.envelope) if self.envelope is not None and self.envelope.rcpt_tos else None
        if txn is not None:
            txn.data_command = True
            if BEHAVIOURS[txn.behaviour].drop_before_data:
                assert self.transport is not None
                self.transport.abort()
                return
        await super().smtp_DATA(arg)


class ScriptedUpstream:
    def __init__(self, port: int, senders: dict[str, tuple[str, str]]) -> None:
        self.port = port
        self.handler = ScriptedHandler(senders)
        self.live: set[_UpstreamSMTP] = set()
        self._server: asyncio.Server | None = None

    @property
    def txns(self) -> list[Txn]:
        return self.handler.txns

    async def start(self) -> None:
        live = self.live
        handler = self.handler

        def make() -> _UpstreamSMTP:
            smtp = _UpstreamSMTP(handler, hostname="upstream", ident="stateful-upstream")
            smtp.live = live
            return smtp

        self._server = await asyncio.get_running_loop().create_server(
            make, "127.0.0.1", self.port, reuse_address=True
        )

    def abort(self, helo: str | None = None) -> None:
        """Close the instance's connections as the kernel does when its process dies (every
        connection when helo is None)."""
        for smtp in list(self.live):
            mine = helo is None or smtp.session is None or smtp.session.host_name == helo
            if mine and smtp.transport is not None:
                smtp.transport.abort()

    async def stop(self) -> None:
        self.abort()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None


# --- Redis: a connection reset between a command and its reply --------------------------------


class WireFaults:
    """A TCP hop between one instance and redis-server. Armed, it passes the next EVALSHA
    (a ledger script) to Redis, which runs it, then closes the connection instead of
    passing the reply on: the write happened, the client saw a reset (and may retry)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.armed = False
        self.fired = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:
            self._handlers.add(me)
            me.add_done_callback(self._handlers.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        doomed = asyncio.Event()

        async def to_server() -> None:
            while data := await reader.read(65536):
                if self.armed and b"EVALSHA" in data[:40]:
                    self.armed = False
                    doomed.set()
                up_writer.write(data)
                await up_writer.drain()

        async def to_client() -> None:
            while data := await up_reader.read(65536):
                if doomed.is_set():
                    if not data.startswith(b"-NOSCRIPT"):
                        self.fired += 1
                        return
                    # The script did not run (Redis lost it): the fault waits for the run
                    # that follows the SCRIPT LOAD.
                    doomed.clear()
                    self.armed = True
                writer.write(data)
                await writer.drain()

        tasks = {asyncio.ensure_future(to_server()), asyncio.ensure_future(to_client())}
        self._tasks |= tasks
        try:
            with contextlib.suppress(ConnectionError, OSError):
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()
            self._tasks -= tasks
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            if self._handlers:
                await asyncio.wait(set(self._handlers), timeout=2)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None


# --- the store proxy -------------------------------------------------------------------------


@dataclass
class Fault:
    method: str
    mode: str
    """before: fails, nothing written; after: written, reply lost; wire: written, the
    connection reset before the reply (Redis only: the client may retry the script)."""


@dataclass
class StoreGate:
    methods: tuple[str, ...]
    when: str
    """before: hold before the call goes out; after: hold once it was answered."""
    matches: Callable[[str, tuple[Any, ...]], bool] = lambda name, args: True
    result_matches: Callable[[Any], bool] = lambda result: True
    gate: Gate = field(default_factory=Gate)


def is_data_sent_mark(name: str, args: tuple[Any, ...]) -> bool:
    rec = args[0] if args else None
    return isinstance(rec, Record) and rec.state is State.IN_FLIGHT and rec.phase is Phase.DATA_SENT


class StoreProxy:
    """Forwards every Store call to one instance's own store. Dead, it forwards nothing and
    answers nothing, as a killed process."""

    def __init__(
        self,
        store: Any,
        clock: Clock,
        wire: WireFaults | None = None,
        unrefunded: dict[str, str] | None = None,
    ) -> None:
        self.unrefunded: dict[str, str] = {} if unrefunded is None else unrefunded
        """Cap token → zone of each refund whose last call did not reach the store: the
        submitter gives up after its tries and keeps the unit (the safe side of a cap)."""
        self._store = store
        self._clock = clock
        self._wire = wire
        self.dead = False
        self.faults: list[Fault] = []
        self.gates: list[StoreGate] = []
        self.claim_probe: Callable[[], bool] | None = None
        self.claim_seen: Callable[[bool, int], None] | None = None
        self.injected: list[str] = []
        self.inflight = 0
        """Calls handed to the store and not yet answered."""
        self._answered = asyncio.Event()
        self._answered.set()

    def now(self) -> float:
        return self._clock()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if not asyncio.iscoroutinefunction(target):
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._call(name, target, args, kwargs)

        return call

    async def answered(self) -> None:
        """Until every call already handed to the store has its answer."""
        await self._answered.wait()

    def _take_fault(self, name: str) -> Fault | None:
        for f in self.faults:
            if f.method == name:
                self.faults.remove(f)
                return f
        return None

    def _take_gate(self, name: str, args: tuple[Any, ...]) -> StoreGate | None:
        for g in self.gates:
            if name in g.methods and g.matches(name, args):
                return g
        return None

    async def _call(
        self, name: str, target: Callable[..., Awaitable[Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self.dead:
            await _forever()
        gate = self._take_gate(name, args)
        if gate is not None and gate.when == "before":
            self.gates.remove(gate)
            await gate.gate.hit()
        fault = self._take_fault(name)
        if fault is not None and fault.mode == "before":
            self.injected.append(f"{name}:before")
            if name == "refund":
                self.unrefunded[args[1]] = args[0]
            raise StoreUnavailable(f"injected: {name} failed before it was sent")
        if fault is not None and fault.mode == "wire" and self._wire is not None:
            self._wire.armed = True
        idle = self.claim_probe() if name == "claim" and self.claim_probe is not None else False
        # Tasks the store starts for itself (a writer's flush) are not the instance's own:
        # a crash leaves what was already handed to the store to finish or fail on its own.
        token = OWNER.set(None)
        self.inflight += 1
        self._answered.clear()
        try:
            result = await target(*args, **kwargs)
            if name == "refund":
                self.unrefunded.pop(args[1], None)
        except StoreUnavailable:
            if name == "refund":
                self.unrefunded[args[1]] = args[0]
            raise
        finally:
            self.inflight -= 1
            if not self.inflight:
                self._answered.set()
            OWNER.reset(token)
            if fault is not None and fault.mode == "wire" and self._wire is not None:
                self._wire.armed = False
        if self.dead:
            await _forever()
        if fault is not None:
            self.injected.append(f"{name}:{fault.mode}")
            if fault.mode == "after":
                raise StoreUnavailable(f"injected: the reply to {name} was lost")
        if name == "claim" and self.claim_seen is not None:
            self.claim_seen(idle, len(result))
        if gate is not None and gate.when == "after" and gate.result_matches(result):
            self.gates.remove(gate)
            await gate.gate.hit()
        return result
