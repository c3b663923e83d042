"""Redis backend: several smtpguard instances sharing one ledger, caps and pause switches.

Durability you need from Redis (docs/redis.md has the full guide): a reservation counts once
Redis has replied, and one Redis then forgets lets the next retry be relayed again (a
duplicate). Run `appendonly yes` with `appendfsync always`, so the AOF is fsynced before the
reply. With `everysec` a crash of the Redis process loses nothing, but a kernel crash or
power loss loses the last ~1-2 s of acknowledged writes. Use `maxmemory-policy noeviction`:
records have no TTL, and an evicted record is a forgotten event. Replication is
asynchronous, so a failover can lose the writes a replica had not received. With
`store.wait: {replicas: N, timeout: …}` every ledger write (the reservation and the
data_sent note among them) is followed by `WAIT N timeout` on the same connection, before
any upstream byte: fewer acknowledgements answer 451 4.3.0 and nothing is sent. WAIT is not
consensus: Sentinel may still promote the replica that missed a write (docs/redis.md).

`redis+sentinel://h1:26379,h2:26379/MASTER/DB` finds the master through Sentinel (redis-py's
Sentinel client) and follows it across a failover. One master holds the whole store: Redis
Cluster is not supported (the keys' `{zone}` hash tags are not enough; a claim and the zone
set span slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import unquote

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from smtpguard.events.model import bare_message_id
from smtpguard.policy.ledger import Record, State
from smtpguard.policy.limits import HOUR, CapCheck, CapReached
from smtpguard.policy.senders import normalize_address, suppression_key
from smtpguard.store import redis_scripts
from smtpguard.store.base import (
    HELD,
    CapUsage,
    CircuitState,
    Claimed,
    Conflict,
    IdField,
    Paused,
    ProbeState,
    QueuedMessage,
    QueueEntry,
    Reserved,
    ReserveResult,
    Slot,
    StoredEvent,
    StoreUnavailable,
    Suppression,
    ZoneAudit,
)

P = ParamSpec("P")
T = TypeVar("T")

_TIMEOUT = 2.0
"""Deadline of one store operation, and of one connect."""
_HEALTH_CHECK_INTERVAL = 10
_MAX_CONNECTIONS = 64
"""What redis-py's own calls and the ledger writes under way may hold at once."""
_SPARE = 16
"""Connections kept out of the pool by RedisStore._command between calls. The pool's limit
is _MAX_CONNECTIONS + _SPARE, so that idle kept connections never take one of the
_MAX_CONNECTIONS from a call (a Sentinel pool refuses past its limit instead of waiting:
a NOSCRIPT storm after a restart, 49 writes each loading its script, got errors)."""
_MONTH_TTL = 40 * 86400
# Window entries are kept as long as SQLite keeps them (its purge drops them after 2 h).
_WINDOW_KEEP = 2 * HOUR
_PURGE_BATCH = 500
# How often one process re-announces a zone in the zone set (it survives a Redis data loss).
_ZONE_ANNOUNCE_EVERY = 300.0
_ZONES = "sg:zones"
# Zones that may have store-and-forward entries: what claim() looks at. A zone is added after
# each enqueue and dropped by a claim that finds its queue empty; every
# _ZONE_ANNOUNCE_EVERY a claim also looks at every known zone, in case an enqueue died
# between its write and that add.
_QUEUED_ZONES = "sg:queued-zones"
# Peek-and-claim rounds of one claim across zones before it settles for fewer entries.
_CLAIM_ROUNDS = 4
_LANES_LISTED = "sg:lanes-listed"
"""Set once every zone's set of lane names holds the lanes of its queue entries."""
_STATES_LISTED = "sg:states-listed"
"""Set once every zone's per-state sets (st:<state>) hold the records written before them."""
_AUDIT_KEPT = 10_000
"""Zone audit entries kept per zone (newest)."""
_SUPP_FOLDED = "sg:supp-folded"
"""Set once every suppression list in this Redis is keyed by suppression_key()."""
_CLOCK_SAMPLE_EVERY = 10.0
"""How often TIME is sampled to follow drift between Redis's clock and ours."""
_SETTLED_EXCLUDED = (State.IN_FLIGHT.value, State.QUEUED.value)

# Every Lua script is a file in redis_lua/ whose header gives its KEYS and ARGV; the parts
# several share (the CAS write, the zone's lookups, the user's cap unit) are in redis_lua/lib/.
_RESERVE = redis_scripts.load("reserve")
_PUT = redis_scripts.load("put")
_REFUND = redis_scripts.load("refund")
_PURGE = redis_scripts.load("purge")
_CONSUME = redis_scripts.load("consume")

# The queue of a zone (DESIGN.md §4a), every key under the zone's hash tag:
#   q:<key>       hash: lane, prio, due, enq, from, rcpt (JSON), body — the message itself
#   lane:<lane>   zset: key → due time (HELD: never due); every entry, claimed or not
#   claimed       zset: key → claimed until; an entry is hidden while its score >= now
#   claimer       hash: key → the token of the claim call that holds it (a retried run
#                 of that call gets it back)
#   queue         set: every key with an entry (queue listing, and "is this zone's queue empty")
# Scripts that must find entries they were not told about (claim, listing, requeue's lane)
# build those keys from the zone prefix: each still hashes to the zone's slot, so the
# script stays on one Cluster node.

_ENQUEUE = redis_scripts.load("enqueue")
_REQUEUE = redis_scripts.load("requeue")
_PEEK = redis_scripts.load("peek")
_CLAIM = redis_scripts.load("claim")
_LANES_OF = redis_scripts.load("lanes_of")
_ENTRIES = redis_scripts.load("entries")
_APPLY_EVENT = redis_scripts.load("apply_event")

_PROBES = "sg:{providers}:probes"
"""Hash (instance, provider) → (ready, detail, at): each instance's last probe, for `stats`."""
_STATES_PAGE = redis_scripts.load("states_page")

_CIRCUITS = "sg:{providers}:circuits"
"""Hash (instance, provider) → (circuit, since): each instance's breakers, for `stats`."""
_THROTTLES = "sg:{providers}:throttles"
"""Hash provider → until: providers throttled by a rate-limit reply (DESIGN.md §16)."""
_RATE_SLOT = redis_scripts.load("rate_slot")
_THROTTLE = redis_scripts.load("throttle")
_HOLD_CONNECTION = redis_scripts.load("hold_connection")


def _zone_key(zone: str, name: str) -> str:
    return f"sg:{{{zone}}}:{name}"


_PAUSED_CLASSES = "sg:{pauses}:classes"
"""Set of "zone\0class": every message class paused (DESIGN.md §16), read whole."""


def _user_keys(zone: str, cap: CapCheck | None) -> list[str]:
    """A user's window, month counter and the zone's token map (USER_UNIT); placeholders
    under the zone's tag when the unit has no user cap, so the script's KEYS stay fixed."""
    user = cap.user if cap is not None and cap.user_caps is not None else None
    month = cap.month if cap is not None else "-"
    if user is None:
        return [_zone_key(zone, "us:"), _zone_key(zone, "um:"), _zone_key(zone, "utok")]
    return [_zone_key(zone, f"us:{user}"), _zone_key(zone, f"um:{user}:{month}"), _zone_key(zone, "utok")]


def _user_args(cap: CapCheck | None) -> list[str | int | float]:
    if cap is None or cap.user is None or cap.user_caps is None:
        return ["0", 0, 0, ""]
    return ["1", cap.user_caps.monthly, cap.user_caps.hourly, cap.user]


def _reached(cap: CapCheck, reply: list[Any]) -> CapReached:
    """The refusal a cap script answered: the zone's month or hour, or the user's."""
    verdict = reply[0]
    user = cap.user if verdict in ("umonth", "uhour") else None
    caps = cap.user_caps if user is not None and cap.user_caps is not None else cap.caps
    if verdict in ("month", "umonth"):
        return CapReached("month", caps.monthly, user=user)
    oldest = float(reply[1]) if reply[1] else None
    return CapReached("hour", caps.hourly, (oldest or cap.now) + HOUR, user=user)


def _record_key(zone: str, key: str) -> str:
    return _zone_key(zone, f"ev:{key}")


def _entry_key(zone: str, key: str) -> str:
    return _zone_key(zone, f"q:{key}")


def _lane_key(zone: str, lane: str) -> str:
    return _zone_key(zone, f"lane:{lane}")


def _rate_key(provider: str) -> str:
    return f"sg:{{rate:{provider}}}:tat"


def _connections_key(provider: str) -> str:
    return f"sg:{{conn:{provider}}}:slots"


def _auth_key(ip: str) -> str:
    return f"sg:{{auth:{ip}}}:fail"


def _translated(
    fn: Callable[Concatenate[RedisStore, P], Awaitable[T]],
) -> Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, T]]:
    """The one place a redis error becomes StoreUnavailable (451 4.3.0, nothing relayed),
    and where an operation gets its deadline."""

    async def wrapper(self: RedisStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            async with asyncio.timeout(_TIMEOUT):
                return await fn(self, *args, **kwargs)
        except (RedisError, OSError) as e:  # OSError includes TimeoutError
            raise StoreUnavailable(f"redis: {type(e).__name__}: {e}") from e

    functools.update_wrapper(wrapper, fn)
    return wrapper


def _load(data: str | None) -> Record | None:
    return Record.from_dict(json.loads(data)) if data else None


def _dump(r: Record) -> str:
    return json.dumps(r.to_dict(), separators=(",", ":"))


def _ids(r: Record) -> tuple[str, str, str]:
    """What redis_lua/lib/indexes.lua indexes the record under: its smtpguard id, its
    Message-ID without <>, its upstream id."""
    return (r.sg_id, bare_message_id(r.message_id) if r.message_id else "", r.upstream_id or "")


_ID_PREFIX: dict[str, tuple[str, int]] = {
    "sg_id": ("s:", 0),
    "message_id": ("m:", 1),
    "upstream_id": ("u:", 2),
}


SENTINEL_SCHEME = "redis+sentinel://"


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """`redis+sentinel://[:password@]h1:26379,h2:26379/MASTER[/DB]` → the sentinels, the
    master's name, the database and the master's password (the sentinels take none)."""
    rest = url.removeprefix(SENTINEL_SCHEME)
    password: str | None = None
    if "@" in rest.split("/", 1)[0]:
        auth, rest = rest.split("@", 1)
        password = unquote(auth.split(":", 1)[1] if ":" in auth else auth) or None
    hosts, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"no master name in {url.split('@')[-1]!r} (redis+sentinel://HOSTS/MASTER/DB)")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
        sentinels.append((name.strip("[]"), int(port or 26379)))
    return sentinels, unquote(parts[0]), int(parts[1]) if len(parts) > 1 else 0, password


class RedisStore:
    def __init__(
        self,
        url: str,
        password: str | None = None,
        read_only: bool = False,
        create: bool = True,
        wait: tuple[int, float] | None = None,
    ) -> None:
        # read_only and create concern a store file; a Redis server has none to create.
        self.url = url
        self._password = password
        self._wait = b""
        """WAIT numreplicas timeout-ms, packed: sent after every ledger write (store.wait)."""
        self._wait_replicas = 0
        if wait is not None and wait[0] > 0:
            self._wait_replicas = wait[0]
            command: tuple[Any, ...] = ("WAIT", wait[0], max(1, round(wait[1] * 1000)))
            self._wait = hiredis.pack_command(command)
        self._client: Redis | None = None
        self._reserve: AsyncScript | None = None
        self._put: AsyncScript | None = None
        self._refund: AsyncScript | None = None
        self._purge: AsyncScript | None = None
        self._consume: AsyncScript | None = None
        self._enqueue: AsyncScript | None = None
        self._requeue: AsyncScript | None = None
        self._peek: AsyncScript | None = None
        self._claim: AsyncScript | None = None
        self._entries: AsyncScript | None = None
        self._lanes_of: AsyncScript | None = None
        self._apply_event: AsyncScript | None = None
        self._states_page: AsyncScript | None = None
        self._rate_slot: AsyncScript | None = None
        self._throttle: AsyncScript | None = None
        self._hold_connection: AsyncScript | None = None
        self._zones_announced: dict[str, float] = {}
        self._spare: list[Any] = []
        """Connections _command keeps between its calls instead of returning them to the
        pool (see _command); at most _SPARE, so redis-py's own calls always find one."""
        self._queued_swept_at: float | None = None
        self._mono: Callable[[], float] = time.monotonic
        self._offset: float | None = None
        """Redis TIME minus this process's monotonic clock, from the last sample."""
        self._last_now = 0.0
        self._clock_task: asyncio.Task[None] | None = None
        self._sentinels: list[Redis] = []
        """A Sentinel URL's clients of the sentinels themselves, closed with the store."""
        self._fold_task: asyncio.Task[None] | None = None

    # --- plumbing ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Build the pool; connections are made on use, so an instance started while Redis
        is down starts anyway, answers 451 and recovers when Redis returns."""
        if self._client is not None:
            return
        options: dict[str, Any] = {
            # No socket_timeout: redis-py then bounds each write with asyncio.wait_for, which
            # on Python 3.11 swallows a cancellation that lands as the write completes, so a
            # cancelled lease renewer would keep running. The deadline is set in _translated.
            "socket_timeout": None,
            "socket_connect_timeout": _TIMEOUT,
            "health_check_interval": _HEALTH_CHECK_INTERVAL,
            "max_connections": _MAX_CONNECTIONS + _SPARE,
            "timeout": _TIMEOUT,
            "decode_responses": True,
            # One quick retry on a dead pooled connection (Redis restarted) and nothing on a
            # timeout: a timed-out script may have run, and running it twice counts twice.
            "retry": Retry(ExponentialBackoff(cap=0.2, base=0.05), 1, (RedisConnectionError,)),
        }
        if self.url.startswith(SENTINEL_SCHEME):
            client = self._sentinel_client(options)
        else:
            options.update(parse_url(self.url))
            if self._password is not None:
                options["password"] = self._password
            client = Redis.from_pool(BlockingConnectionPool(**options))
        self._reserve = client.register_script(_RESERVE)
        self._put = client.register_script(_PUT)
        self._refund = client.register_script(_REFUND)
        self._purge = client.register_script(_PURGE)
        self._consume = client.register_script(_CONSUME)
        self._enqueue = client.register_script(_ENQUEUE)
        self._requeue = client.register_script(_REQUEUE)
        self._peek = client.register_script(_PEEK)
        self._claim = client.register_script(_CLAIM)
        self._entries = client.register_script(_ENTRIES)
        self._lanes_of = client.register_script(_LANES_OF)
        self._apply_event = client.register_script(_APPLY_EVENT)
        self._states_page = client.register_script(_STATES_PAGE)
        self._rate_slot = client.register_script(_RATE_SLOT)
        self._throttle = client.register_script(_THROTTLE)
        self._hold_connection = client.register_script(_HOLD_CONNECTION)
        self._client = client
        # Down at start: the local clock until the first sample (see now()).
        with contextlib.suppress(StoreUnavailable):
            await self.sync_clock()
        self._clock_task = asyncio.create_task(self._track_clock())
        self._fold_task = asyncio.create_task(self._upgrade())

    async def close(self) -> None:
        for task in (self._clock_task, self._fold_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._clock_task = self._fold_task = None
        if self._client is not None:
            client, self._client = self._client, None
            spare, self._spare = self._spare, []
            for conn in spare:
                with contextlib.suppress(Exception):
                    await client.connection_pool.release(conn)
            await client.aclose()
            sentinels, self._sentinels = self._sentinels, []
            for s in sentinels:
                with contextlib.suppress(Exception):
                    await s.aclose()

    def _sentinel_client(self, options: dict[str, Any]) -> Redis:
        """The master named in the URL, found through its sentinels; a connection asks them
        again whenever it (re)connects, so a failover is followed without a restart."""
        sentinels, service, db, password = parse_sentinel_url(self.url)
        options = {k: v for k, v in options.items() if k not in ("max_connections", "timeout")}
        if self._password is not None:
            password = self._password
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            sentinels,
            socket_timeout=_TIMEOUT,
            socket_connect_timeout=_TIMEOUT,
            sentinel_kwargs={"socket_timeout": _TIMEOUT, "socket_connect_timeout": _TIMEOUT},
        )
        client: Redis = sentinel.master_for(
            service,
            db=db,
            password=password,
            max_connections=_MAX_CONNECTIONS + _SPARE,
            **options,
        )
        self._sentinels = list(sentinel.sentinels)
        return client

    # --- the store's clock (DESIGN.md §11.5) --------------------------------------------------
    def now(self) -> float:
        """Redis TIME, tracked between samples on this process's monotonic clock.

        Every instance measures leases on the same clock, so a host whose wall clock is
        minutes off neither expires another's live lease nor keeps a dead one alive. The
        error is half a round trip at a sample plus monotonic drift since (ppm): far below
        a lease. The monotonic clock never steps, so neither does this; a new sample never
        moves it backwards."""
        if self._offset is None:
            return time.time()
        t = self._mono() + self._offset
        if t < self._last_now:
            return self._last_now
        self._last_now = t
        return t

    @_translated
    async def sync_clock(self) -> None:
        before = self._mono()
        sec, usec = await self._r.time()
        after = self._mono()
        self._offset = sec + usec / 1e6 - (before + after) / 2

    async def _track_clock(self) -> None:
        while True:
            # Until the first sample (Redis was down at open) this instance runs on its own
            # clock: look again soon, not in ten seconds.
            await asyncio.sleep(_CLOCK_SAMPLE_EVERY if self._offset is not None else 0.2)
            with contextlib.suppress(StoreUnavailable):
                await self.sync_clock()

    @_translated
    async def durability_problems(self) -> list[str]:
        """DESIGN.md §15: a Redis that may forget an acknowledged reservation turns a restart
        or an eviction into a duplicate send."""
        try:
            got: dict[str, str] = {}
            for name in ("appendonly", "appendfsync", "maxmemory-policy", "maxmemory"):
                got.update({str(k): str(v) for k, v in (await self._r.config_get(name)).items()})
        except ResponseError as e:
            # Fail closed: an unverifiable store is judged as an unsafe one (store.unsafe
            # turns this into a warning, as for any other finding).
            return [
                f"CONFIG GET is refused ({e}), so appendonly, appendfsync and "
                "maxmemory-policy cannot be checked; grant the store's Redis user +config|get "
                "(docs/redis.md, Security)"
            ]
        problems = []
        if got.get("appendonly") != "yes":
            problems.append(
                f"redis appendonly is {got.get('appendonly')!r}, not 'yes': a restart forgets events"
            )
        if got.get("appendfsync") != "always":
            problems.append(
                f"redis appendfsync is {got.get('appendfsync')!r}, not 'always': "
                "a crash loses the last acknowledged writes"
            )
        if got.get("maxmemory-policy") != "noeviction" and got.get("maxmemory", "0") != "0":
            problems.append(
                f"redis maxmemory-policy is {got.get('maxmemory-policy')!r} with maxmemory "
                f"{got.get('maxmemory')}: an evicted record is a forgotten event; use noeviction"
            )
        return problems

    @property
    def _r(self) -> Redis:
        if self._client is None:
            raise StoreUnavailable("store is not open")
        return self._client

    @staticmethod
    def _script(script: AsyncScript | None) -> AsyncScript:
        if script is None:
            raise StoreUnavailable("store is not open")
        return script

    async def ping(self) -> bool:
        try:
            return await self._ping()
        except StoreUnavailable:
            return False

    @_translated
    async def _ping(self) -> bool:
        return bool(await self._r.ping())

    async def _announce_zone(self, zone: str) -> None:
        """Record the zone in the zone set purge walks; at most every few minutes per process."""
        now = time.monotonic()
        last = self._zones_announced.get(zone)
        if last is not None and now - last < _ZONE_ANNOUNCE_EVERY:
            return
        # Marked first, so a burst of new keys sends one SADD, not one each.
        self._zones_announced[zone] = now
        try:
            await self._r.sadd(_ZONES, zone)
        except BaseException:
            self._zones_announced.pop(zone, None)
            raise

    # --- ledger ------------------------------------------------------------------------------
    @_translated
    async def get(self, zone: str, key: str) -> Record | None:
        data = await self._r.hget(_record_key(zone, key), "d")
        return _load(data if isinstance(data, str) else None)

    @_translated
    async def reserve(
        self, record: Record, expected_version: int | None, cap: CapCheck | None, paused: bool
    ) -> ReserveResult:
        zone = record.zone
        await self._announce_zone(zone)
        cap_zone = cap.zone if cap is not None else zone
        month = cap.month if cap is not None else "-"
        keys = [
            _record_key(zone, record.key),
            _zone_key(zone, "paused"),
            _zone_key(cap_zone, "sends"),
            _zone_key(cap_zone, f"month:{month}"),
            _zone_key(zone, "idx"),
            *_user_keys(cap_zone, cap),
        ]
        args: list[str | int | float] = [
            "" if expected_version is None else str(expected_version),
            "1" if paused else "0",
            "1" if cap is not None else "0",
            cap.caps.monthly if cap is not None else 0,
            cap.caps.hourly if cap is not None else 0,
            cap.hour_start if cap is not None else 0.0,
            cap.token if cap is not None else "",
            cap.now if cap is not None else 0.0,
            cap.now - _WINDOW_KEEP if cap is not None else 0.0,
            _MONTH_TTL,
            str(record.version),
            record.state.value,
            _dump(record),
            record.updated_at,
            record.key,
            *_user_args(cap),
            *_ids(record),
        ]
        reply = await self._eval(self._reserve, keys, args, replicated=True)
        verdict = reply[0]
        if verdict == "ok":
            return Reserved()
        if verdict == "conflict":
            return Conflict(_load(reply[1]))
        if verdict == "paused":
            return Paused()
        assert cap is not None
        return _reached(cap, reply)

    @_translated
    async def put(self, record: Record, expected_version: int | None) -> Conflict | None:
        if expected_version is None:
            await self._announce_zone(record.zone)
        keys = [_record_key(record.zone, record.key), _zone_key(record.zone, "idx")]
        args = [
            "" if expected_version is None else str(expected_version),
            str(record.version),
            record.state.value,
            _dump(record),
            record.updated_at,
            record.key,
            *_ids(record),
        ]
        reply = await self._eval(self._put, keys, args, replicated=True)
        if reply[0] == "ok":
            return None
        return Conflict(_load(reply[1]))

    @_translated
    async def refund(self, zone: str, token: str, month: str) -> None:
        keys = [_zone_key(zone, "sends"), _zone_key(zone, f"month:{month}"), _zone_key(zone, "utok")]
        await self._eval(self._refund, keys, [token, _zone_key(zone, ""), month])

    async def purge(self, now: float, retention: float) -> int:
        # Not one deadline for the whole purge: each round trip below has its own.
        cutoff = now - retention
        deleted = 0
        for zone in await self._known_zones():
            offset = 0
            while True:
                members = await self._purge_candidates(zone, cutoff, offset)
                if not members:
                    break
                done, kept = await self._purge_batch(zone, cutoff, members)
                deleted += done
                # Old records still in_flight/queued stay in the index: step over them.
                offset += kept
                if len(members) < _PURGE_BATCH:
                    break
            await self._trim_window(zone, now - _WINDOW_KEEP)
            await self._trim_event_ids(zone, cutoff)
        # AUTH failure keys expire by themselves (see auth_failure).
        return deleted

    @_translated
    async def _known_zones(self) -> list[str]:
        return sorted(str(z) for z in await self._r.smembers(_ZONES))

    @_translated
    async def _purge_candidates(self, zone: str, cutoff: float, offset: int) -> list[str]:
        members = await self._r.zrangebyscore(
            _zone_key(zone, "idx"), "-inf", f"({cutoff!r}", start=offset, num=_PURGE_BATCH
        )
        return [str(m) for m in members]

    @_translated
    async def _purge_batch(self, zone: str, cutoff: float, members: list[str]) -> tuple[int, int]:
        keys = [_zone_key(zone, "idx"), *(_record_key(zone, m) for m in members)]
        done, kept = await self._eval(self._purge, keys, [cutoff, *_SETTLED_EXCLUDED, *members])
        return int(done), int(kept)

    @_translated
    async def _trim_event_ids(self, zone: str, before: float) -> None:
        await self._r.zremrangebyscore(_zone_key(zone, "pev-ids"), "-inf", f"({before!r}")

    @_translated
    async def _trim_window(self, zone: str, before: float) -> None:
        await self._r.zremrangebyscore(_zone_key(zone, "sends"), "-inf", f"({before!r}")
        # The user units' token map: entries past any window that reads them (the user
        # windows themselves are trimmed by each unit counted).
        tokens = _zone_key(zone, "utok")
        old = [t async for t, held in self._r.hscan_iter(tokens) if float(str(held).split("|")[0]) < before]
        if old:
            await self._r.hdel(tokens, *old)

    @_translated
    async def consume_cap(self, cap: CapCheck) -> CapReached | None:
        # Announced so that purge trims the zone's window, as it does for reserve().
        await self._announce_zone(cap.zone)
        keys = [
            _zone_key(cap.zone, "sends"),
            _zone_key(cap.zone, f"month:{cap.month}"),
            *_user_keys(cap.zone, cap),
        ]
        args: list[str | int | float] = [
            cap.caps.monthly,
            cap.caps.hourly,
            cap.hour_start,
            cap.token,
            cap.now,
            cap.now - _WINDOW_KEEP,
            _MONTH_TTL,
            *_user_args(cap),
        ]
        reply = await self._eval(self._consume, keys, args)
        if reply[0] == "ok":
            return None
        return _reached(cap, reply)

    # --- store-and-forward queue -------------------------------------------------------------
    async def enqueue(
        self, record: Record, expected_version: int | None, message: QueuedMessage
    ) -> Conflict | None:
        conflict = await self._enqueue_entry(record, expected_version, message)
        if conflict is None:
            # After the write: a claim that found the zone's queue empty and is dropping the
            # zone re-checks after its SREM, so one of the two always leaves the zone listed.
            await self._add_queued_zone(record.zone)
        return conflict

    @_translated
    async def _enqueue_entry(
        self, record: Record, expected_version: int | None, message: QueuedMessage
    ) -> Conflict | None:
        zone, lane = record.zone, record.lane or ""
        await self._announce_zone(zone)
        keys = [
            _record_key(zone, record.key),
            _zone_key(zone, "idx"),
            _entry_key(zone, record.key),
            _zone_key(zone, "claimed"),
            _zone_key(zone, "queue"),
            _lane_key(zone, lane),
        ]
        args: list[str | int | float | bytes] = [
            "" if expected_version is None else str(expected_version),
            str(record.version),
            record.state.value,
            _dump(record),
            record.updated_at,
            record.key,
            _zone_key(zone, ""),
            lane,
            message.priority,
            record.next_attempt_at if record.next_attempt_at is not None else record.updated_at,
            record.updated_at,
            message.sender,
            json.dumps(list(message.recipients)),
            message.content,
            "1" if message.smtputf8 else "0",
            *_ids(record),
        ]
        reply = await self._eval(self._enqueue, keys, args, replicated=True)
        if reply[0] == "ok":
            return None
        return Conflict(_load(reply[1]))

    @_translated
    async def _add_queued_zone(self, zone: str) -> None:
        await self._r.sadd(_QUEUED_ZONES, zone)

    @_translated
    async def requeue(self, record: Record, expected_version: int, due: float | None) -> Conflict | None:
        zone = record.zone
        keys = [
            _record_key(zone, record.key),
            _zone_key(zone, "idx"),
            _entry_key(zone, record.key),
            _zone_key(zone, "claimed"),
            _zone_key(zone, "queue"),
        ]
        args: list[str | float] = [
            str(expected_version),
            str(record.version),
            record.state.value,
            _dump(record),
            record.updated_at,
            record.key,
            _zone_key(zone, ""),
            "" if due is None else due,
            *_ids(record),
        ]
        reply = await self._eval(self._requeue, keys, args, replicated=True)
        if reply[0] == "ok":
            return None
        return Conflict(_load(reply[1]))

    async def claim(self, now: float, quotas: list[tuple[str, int]], lease: float) -> list[Claimed]:
        """Claims zone by zone: each zone's script is atomic in its slot, which is all a claim
        needs (an entry belongs to one zone, and a claimed entry is hidden from every other
        script). With several zones queued, a pipelined peek first finds the oldest due
        entries across zones, so zones are served in due order as by the SQLite backend; a
        zone that gives fewer than planned (a rival claimed them since the peek) sends the
        claim round again for what is left."""
        lanes: list[str] = []
        counts: list[int] = []
        for lane, n in quotas:
            if lane in lanes:
                counts[lanes.index(lane)] += max(n, 0)
            else:
                lanes.append(lane)
                counts.append(max(n, 0))
        total = sum(counts)
        if total <= 0:
            return []
        listed = set(await self._smembers(_QUEUED_ZONES))
        zones = set(listed)
        swept = self._queued_swept_at
        if swept is None or time.monotonic() - swept >= _ZONE_ANNOUNCE_EVERY:
            zones |= set(await self._smembers(_ZONES))
            self._queued_swept_at = time.monotonic()
        if not zones:
            return []
        got: list[tuple[int, float, str, str, Claimed]] = []
        sizes: dict[str, int] = {}
        want, room = counts, total
        for _ in range(_CLAIM_ROUNDS):
            plan: dict[str, tuple[list[int], int]]
            if len(zones) == 1:
                # The zone's script alone makes the whole choice, quotas then fill.
                plan = {zone: (want, room) for zone in zones}
            else:
                peeked, due = await self._peek_zones(sorted(zones), lanes, now, room)
                sizes.update(peeked)
                plan = {zone: (n, sum(n)) for zone, n in _plan(due, want, room).items()}
            results = await asyncio.gather(
                *(self._claim_zone(zone, lanes, n, t, now, now + lease) for zone, (n, t) in plan.items()),
                return_exceptions=True,
            )
            short = False
            errors: list[BaseException] = []
            for (zone, (_, planned)), result in zip(plan.items(), results, strict=True):
                if isinstance(result, BaseException):
                    errors.append(result)
                    continue
                sizes[zone] = result[0]
                got += result[1]
                short = short or len(result[1]) < planned
            if errors:
                if not got:
                    raise errors[0]
                # What was claimed is returned; the error comes back on the next claim.
                break
            room = total - len(got)
            if not short or room <= 0 or len(zones) == 1:
                break
            per_lane = [sum(1 for g in got if g[0] == li) for li in range(len(lanes))]
            want = [max(n - k, 0) for n, k in zip(counts, per_lane, strict=True)]
        await self._tidy_queued_zones(listed, sizes)
        # The order the SQLite backend returns: each lane's quota, oldest first, then the fill.
        by_lane: list[list[Claimed]] = [[] for _ in lanes]
        for li, _, _, _, claimed in sorted(got, key=lambda g: g[:4]):
            by_lane[li].append(claimed)
        ordered = [c for li, n in enumerate(counts) for c in by_lane[li][:n]]
        return ordered + [c for li, n in enumerate(counts) for c in by_lane[li][n:]]

    @_translated
    async def _smembers(self, key: str) -> list[str]:
        return [str(m) for m in await self._r.smembers(key)]

    @_translated
    async def _peek_zones(
        self, zones: list[str], lanes: list[str], now: float, limit: int
    ) -> tuple[dict[str, int], list[list[tuple[float, str, str]]]]:
        """Each zone's queue size, and per lane the due, unclaimed (due, zone, key) entries."""
        script = self._script(self._peek)
        async with self._r.pipeline(transaction=False) as pipe:
            for zone in zones:
                keys = [_zone_key(zone, "claimed"), _zone_key(zone, "queue")]
                keys += [_lane_key(zone, lane) for lane in lanes]
                await script(keys, [now, limit], client=pipe)
            replies = await pipe.execute()
        sizes: dict[str, int] = {}
        due: list[list[tuple[float, str, str]]] = [[] for _ in lanes]
        for zone, reply in zip(zones, replies, strict=True):
            sizes[zone] = int(reply[0])
            for li, found in enumerate(reply[1:]):
                due[li] += [(float(found[i + 1]), zone, str(found[i])) for i in range(0, len(found), 2)]
        return sizes, due

    async def _tidy_queued_zones(self, listed: set[str], sizes: dict[str, int]) -> None:
        for zone, size in sizes.items():
            if size and zone not in listed:
                await self._add_queued_zone(zone)
            elif not size and zone in listed:
                await self._drop_queued_zone(zone)

    @_translated
    async def _drop_queued_zone(self, zone: str) -> None:
        await self._r.srem(_QUEUED_ZONES, zone)
        # An enqueue may have written after our look and added the zone before our SREM.
        if await self._r.scard(_zone_key(zone, "queue")):
            await self._r.sadd(_QUEUED_ZONES, zone)

    @_translated
    async def _claim_zone(
        self, zone: str, lanes: list[str], counts: list[int], total: int, now: float, until: float
    ) -> tuple[int, list[tuple[int, float, str, str, Claimed]]]:
        keys = [_zone_key(zone, "claimed"), _zone_key(zone, "queue")]
        keys += [_lane_key(zone, lane) for lane in lanes]
        # A token per call, the same in a retried run: it recognises its own claims.
        args = [now, until, total, _zone_key(zone, ""), secrets.token_hex(8), *counts]
        # Undecoded: the message content is bytes, not necessarily UTF-8.
        size, entries = await self._eval(self._claim, keys, args, raw=True)
        out: list[tuple[int, float, str, str, Claimed]] = []
        for key, li, due, data, sender, recipients, content, priority, utf8 in entries:
            record = Record.from_dict(json.loads(data))
            message = QueuedMessage(
                sender.decode(), tuple(json.loads(recipients)), bytes(content), int(priority), utf8 == b"1"
            )
            out.append((int(li) - 1, float(due), zone, key.decode(), Claimed(record, message)))
        return int(size), out

    async def _eval(
        self,
        script: AsyncScript | None,
        keys: list[str],
        args: list[Any],
        raw: bool = False,
        replicated: bool = False,
    ) -> Any:
        """EVALSHA, loading the script if Redis lost it; `raw` leaves the reply as bytes.
        `replicated`: a ledger write, followed by store.wait's WAIT when that is set."""
        loaded = self._script(script)
        packed = hiredis.pack_command(("EVALSHA", loaded.sha, len(keys), *keys, *args))
        wait = self._wait if replicated else b""
        try:
            return await self._command(packed, raw, wait)
        except NoScriptError:
            # Redis restarted or was flushed: load the script and run it (it has not run).
            await self._r.script_load(loaded.script)
            return await self._command(packed, raw, wait)

    async def _command(self, packed: bytes, raw: bool, wait: bytes = b"") -> Any:
        """One command, packed by hiredis, on a pooled connection.

        What Redis.execute_command does, without its per-call layers (Python packing, the
        retry wrapper, observability hooks): those cost about as much CPU as the rest of a
        ledger write. The failure handling is the same: a connection error drops the
        connection and is retried once, after 50 ms (a pooled connection that died with a
        Redis restart); an error reply is raised as redis-py raises it.

        A connection whose reply was read whole is kept for the next call rather than
        handed back to the pool: the pool's checkout (its lock and condition, a readiness
        poll of the socket, metrics hooks, a deprecation wrapper) cost about as much CPU
        per ledger write as the write itself. A kept connection still runs redis-py's
        health check before each command; one that fails goes back to the pool.

        A kept connection skips the pool's checkout check (is the socket still open; for
        Sentinel, is its address still the master's): after a Redis restart or a failover
        every kept connection is stale at once. So a connection error drops them all, and
        the retry takes its connection from the pool, which checks it (and asks the
        sentinels again): one retry per write is enough, as before they were kept."""
        pool = self._r.connection_pool
        spare = self._spare
        for attempt in (1, 2):
            if spare and attempt == 1:
                conn = spare.pop()
            else:
                conn = await pool.get_connection()  # type: ignore[no-untyped-call]
            clean = False
            try:
                if not wait:
                    await conn.send_packed_command(packed)
                    reply = await conn.read_response(disable_decoding=raw)
                    clean = True
                    return reply
                # WAIT on the same connection, pipelined: it waits for this connection's
                # writes, the script's among them.
                await conn.send_packed_command(packed + wait)
                try:
                    reply = await conn.read_response(disable_decoding=raw)
                except ResponseError:
                    await conn.read_response()  # WAIT's reply: the connection stays in step
                    raise
                # Not in a `finally`: after a cancellation or a connection error redis-py
                # has dropped the connection, and reading WAIT's reply from it would raise a
                # connection error in the cancellation's place, which is retried: the script
                # sent again (it may have run) and the cancellation lost.
                acked = await conn.read_response()
                clean = True
                if int(acked) < self._wait_replicas:
                    raise StoreUnavailable(
                        f"redis: WAIT: {acked} of {self._wait_replicas} replicas acknowledged the write"
                    )
                return reply
            except ResponseError:
                clean = True  # an error reply, read whole: the connection is in step
                raise
            except StoreUnavailable:
                raise
            except RedisConnectionError:
                await conn.disconnect(nowait=True)
                await self._drop_spare(pool)
                if attempt == 2:
                    raise
            except BaseException:
                # Cancelled (the operation's deadline) halfway through a write or a read:
                # the connection is not reused.
                await conn.disconnect(nowait=True)
                raise
            finally:
                # `spare is self._spare`: not kept past close() (which empties the list).
                if clean and len(spare) < _SPARE and spare is self._spare and self._client is not None:
                    spare.append(conn)
                else:
                    await pool.release(conn)
            await asyncio.sleep(0.05)
        raise AssertionError("unreachable")

    async def _drop_spare(self, pool: Any) -> None:
        """Disconnect the kept connections and give them back to the pool (which reconnects
        them on checkout): one failed with a connection error, so they are likely all stale
        (Redis restarted, or the master moved)."""
        dropped = self._spare[:]
        self._spare.clear()  # the same list: the calls under way may keep theirs again
        for conn in dropped:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)
            await pool.release(conn)

    async def queue_lanes(self) -> set[str]:
        lanes: set[str] = set()
        for zone in await self._smembers(_QUEUED_ZONES):
            lanes |= await self._zone_lanes(zone)
        return lanes

    @_translated
    async def _zone_lanes(self, zone: str) -> set[str]:
        """The zone's lanes that hold entries. The set of lane names only grows (each enqueue
        adds its lane in the same script as the entry): removing an empty one here could
        race an enqueue into it and hide that entry from the orphan scan."""
        found: set[str] = set()
        for lane in await self._r.smembers(_zone_key(zone, "lanes")):
            if await self._r.zcard(_lane_key(zone, str(lane))):
                found.add(str(lane))
        return found

    async def queue_entries(self, zone: str | None) -> list[QueueEntry]:
        if zone is not None:
            zones = [zone]
        else:
            zones = sorted(set(await self._smembers(_QUEUED_ZONES)) | set(await self._smembers(_ZONES)))
        now = time.time()
        out: list[tuple[int, float, QueueEntry]] = []
        for z in zones:
            for key, lane, priority, due, enqueued, size, state, until in await self._zone_entries(z):
                due_at = float(due)
                entry = QueueEntry(
                    z,
                    key,
                    lane,
                    state or "?",
                    None if due_at >= HELD else due_at,
                    bool(until) and float(until) > now,
                    float(enqueued),
                    int(size),
                )
                out.append((int(priority), due_at, entry))
        out.sort(key=lambda e: (e[0], e[1], e[2].zone, e[2].key))
        return [entry for _, _, entry in out]

    @_translated
    async def queue_depths(self) -> dict[tuple[str, str], int]:
        zones = sorted(set(await self._smembers(_QUEUED_ZONES)) | set(await self._smembers(_ZONES)))
        async with self._r.pipeline(transaction=False) as pipe:
            for z in zones:
                pipe.smembers(_zone_key(z, "lanes"))
            lane_sets: list[set[Any]] = await pipe.execute()
        pairs = [(z, str(lane)) for z, lanes in zip(zones, lane_sets, strict=True) for lane in sorted(lanes)]
        async with self._r.pipeline(transaction=False) as pipe:
            for z, lane in pairs:
                pipe.zcard(_lane_key(z, lane))
            counts: list[int] = await pipe.execute()
        return {pair: int(n) for pair, n in zip(pairs, counts, strict=True) if n}

    @_translated
    async def _zone_entries(self, zone: str) -> list[list[Any]]:
        keys = [_zone_key(zone, "queue"), _zone_key(zone, "claimed")]
        entries: list[list[Any]] = await self._eval(self._entries, keys, [_zone_key(zone, "")])
        return entries

    # --- zones -------------------------------------------------------------------------------
    @_translated
    async def set_paused(self, zone: str, paused: bool) -> None:
        if paused:
            await self._r.set(_zone_key(zone, "paused"), "1")
        else:
            await self._r.delete(_zone_key(zone, "paused"))

    @_translated
    async def is_paused(self, zone: str) -> bool:
        return bool(await self._r.exists(_zone_key(zone, "paused")))

    @_translated
    async def set_class_paused(self, zone: str, message_class: str, paused: bool) -> None:
        member = f"{zone}\x00{message_class}"
        if paused:
            await self._r.sadd(_PAUSED_CLASSES, member)
        else:
            await self._r.srem(_PAUSED_CLASSES, member)

    @_translated
    async def paused_classes(self) -> set[tuple[str, str]]:
        members = await self._r.smembers(_PAUSED_CLASSES)
        pairs = (str(m).split("\x00", 1) for m in members)
        return {(p[0], p[1]) for p in pairs if len(p) == 2}

    @_translated
    async def user_cap_usage(
        self, zone: str, usernames: list[str], now: float, month: str
    ) -> dict[str, CapUsage]:
        if not usernames:
            return {}
        async with self._r.pipeline(transaction=False) as pipe:
            for user in usernames:
                pipe.zcount(_zone_key(zone, f"us:{user}"), now - HOUR, "+inf")
                pipe.get(_zone_key(zone, f"um:{user}:{month}"))
            values = await pipe.execute()
        return {
            user: CapUsage(hour=int(values[2 * i]), month=int(values[2 * i + 1] or 0))
            for i, user in enumerate(usernames)
        }

    @_translated
    async def cap_usage(self, zone: str, now: float, month: str) -> CapUsage:
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.zcount(_zone_key(zone, "sends"), now - HOUR, "+inf")
            pipe.get(_zone_key(zone, f"month:{month}"))
            hour, used = await pipe.execute()
        return CapUsage(hour=int(hour), month=int(used or 0))

    @_translated
    async def add_counts(self, zone: str, counts: dict[str, int]) -> None:
        if not counts:
            return
        key = _zone_key(zone, "counts")
        async with self._r.pipeline(transaction=True) as pipe:
            for name, n in counts.items():
                pipe.hincrby(key, name, n)
            await pipe.execute()

    @_translated
    async def counts(self, zone: str) -> dict[str, int]:
        values = await self._r.hgetall(_zone_key(zone, "counts"))
        return {str(name): int(value) for name, value in values.items()}

    # --- suppression -------------------------------------------------------------------------
    @_translated
    async def suppressed(self, zone: str, address: str) -> str | None:
        # The folded key, and the address as an earlier version keyed it until the
        # background fold has re-keyed every list (_fold_suppression_keys).
        forms = {suppression_key(address), normalize_address(address)}
        # Two slots (the zone's and global's): a plain pipeline, one round trip, no MULTI.
        async with self._r.pipeline(transaction=False) as pipe:
            for owner in (zone, "global"):
                for form in forms:
                    pipe.hexists(_zone_key(owner, "supp"), form)
            found = await pipe.execute()
        n = len(forms)
        if any(found[:n]):
            return zone
        return "global" if any(found[n:]) else None

    @_translated
    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        entry = json.dumps({"reason": reason, "at": now}, separators=(",", ":"))
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hsetnx(_zone_key(zone, "supp"), suppression_key(address), entry)
            pipe.incr(_zone_key(zone, "supp:v"))
            added, _ = await pipe.execute()
        return bool(added)

    @_translated
    async def suppress_remove(self, zone: str, address: str) -> bool:
        forms = {suppression_key(address), normalize_address(address)}
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hdel(_zone_key(zone, "supp"), *forms)
            pipe.incr(_zone_key(zone, "supp:v"))
            removed, _ = await pipe.execute()
        return bool(removed)

    async def _upgrade(self) -> None:
        """Once per Redis (a marker each says it is done), for data an earlier version wrote:
        the set of each zone's lane names is filled from its queue entries (the orphan lane
        scan reads it), and suppression entries are re-keyed by policy/senders.
        suppression_key (lookups meanwhile try both forms). In the background, a page at a
        time (a long list outlasts one operation's deadline); idempotent, so instances may
        run it concurrently."""
        while True:
            try:
                if not await self._flag_get(_LANES_LISTED):
                    for zone in await self._known_zones():
                        await self._list_lanes(zone)
                    await self._flag_set(_LANES_LISTED)
                if not await self._flag_get(_STATES_LISTED):
                    for zone in await self._known_zones():
                        await self._list_states(zone)
                    await self._flag_set(_STATES_LISTED)
                if not await self._flag_get(_SUPP_FOLDED):
                    for zone in [*await self._known_zones(), "global"]:
                        await self._fold_zone(zone)
                    await self._flag_set(_SUPP_FOLDED)
                return
            except StoreUnavailable:
                await asyncio.sleep(1.0)

    @_translated
    async def _flag_get(self, flag: str) -> bool:
        return bool(await self._r.exists(flag))

    @_translated
    async def _flag_set(self, flag: str) -> None:
        await self._r.set(flag, "1")

    @_translated
    async def _list_lanes(self, zone: str) -> None:
        await self._eval(
            self._lanes_of, [_zone_key(zone, "queue"), _zone_key(zone, "lanes")], [_zone_key(zone, "")]
        )

    async def _fold_zone(self, zone: str) -> None:
        cursor = 0
        while True:
            cursor, moved = await self._fold_page(zone, cursor)
            if moved:
                await self._bump_supp(zone)
            if cursor == 0:
                return

    @_translated
    async def _fold_page(self, zone: str, cursor: int) -> tuple[int, bool]:
        key = _zone_key(zone, "supp")
        cursor, page = await self._r.hscan(key, cursor, count=500)
        assert isinstance(page, dict)
        stale = {str(a): e for a, e in page.items() if suppression_key(str(a)) != a}
        if stale:
            async with self._r.pipeline(transaction=True) as pipe:
                for address, entry in stale.items():
                    pipe.hsetnx(key, suppression_key(address), entry)
                    pipe.hdel(key, address)
                await pipe.execute()
        return int(cursor), bool(stale)

    @_translated
    async def _bump_supp(self, zone: str) -> None:
        await self._r.incr(_zone_key(zone, "supp:v"))

    @_translated
    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        # Two slots (the zone's and global's): a plain pipeline, no transaction.
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.get(_zone_key(zone, "supp:v"))
            pipe.get(_zone_key("global", "supp:v"))
            own, shared = await pipe.execute()
        return int(own or 0), int(shared or 0)

    @_translated
    async def suppress_list(self, zone: str) -> list[Suppression]:
        entries = await self._r.hgetall(_zone_key(zone, "supp"))
        result = []
        for address, raw in sorted(entries.items()):
            entry = json.loads(raw)
            result.append(Suppression(zone, str(address), str(entry["reason"]), float(entry["at"])))
        return result

    # --- provider events ---------------------------------------------------------------------
    @_translated
    async def find_records(self, field: IdField, value: str) -> list[Record]:
        wanted = bare_message_id(value) if field == "message_id" else value.strip()
        prefix, position = _ID_PREFIX[field]
        name = prefix + wanted
        zones = sorted(str(z) for z in await self._r.smembers(_ZONES))
        async with self._r.pipeline(transaction=False) as pipe:
            for zone in zones:
                pipe.hget(_zone_key(zone, "ids"), name)
            keys = await pipe.execute()
        found = []
        for zone, key in zip(zones, keys, strict=True):
            if not key:
                continue
            data = await self._r.hget(_record_key(zone, str(key)), "d")
            record = _load(data if isinstance(data, str) else None)
            # The entry may be stale (the record moved on to another attempt's ids).
            if record is not None and _ids(record)[position] == wanted:
                found.append(record)
        return found

    async def records_for_event(self, field: IdField, value: str) -> list[Record]:
        # The ids hash of each zone names one record per id, and every zone is read: the
        # whole answer, so the one-zone rule holds however many records shared the id.
        found = await self.find_records(field, value)
        return found if len({r.zone for r in found}) <= 1 else []

    @_translated
    async def apply_event(self, zone: str, key: str, event: StoredEvent, suppress_reason: str | None) -> bool:
        address = ""
        entry = ""
        if suppress_reason is not None and event.recipient is not None:
            address = suppression_key(event.recipient)
            entry = json.dumps({"reason": suppress_reason, "at": event.received_at}, separators=(",", ":"))
        keys = [
            _zone_key(zone, "pev-ids"),
            _zone_key(zone, f"pev:{key}"),
            _zone_key(zone, "supp"),
            _zone_key(zone, "supp:v"),
        ]
        args = [
            f"{event.source}\x00{event.id}",
            event.received_at,
            json.dumps(event.to_dict(), separators=(",", ":")),
            address,
            entry,
        ]
        applied = await self._eval(self._apply_event, keys, args)
        return bool(applied)

    @_translated
    async def remember_nonce(self, name: str, digest: str, until: float) -> bool:
        key = f"sg:nonce:{name}"
        ttl = max(1, math.ceil(until - self.now()))
        if await self._r.set(key, digest, nx=True, ex=ttl):
            return True
        return bool(await self._r.get(key) == digest)

    @_translated
    async def provider_events(self, zone: str, key: str) -> list[StoredEvent]:
        items = await self._r.lrange(_zone_key(zone, f"pev:{key}"), 0, -1)
        return [StoredEvent.from_dict(json.loads(item)) for item in items]

    # --- the operator's desk ------------------------------------------------------------------
    @_translated
    async def list_records(
        self, zone: str, state: str | None, since: float | None, before: float | None, limit: int
    ) -> list[Record]:
        high = f"({before!r}" if before is not None else "+inf"
        low = repr(since) if since is not None else "-inf"
        if state is None or await self._flag_get(_STATES_LISTED):
            index = _zone_key(zone, "idx" if state is None else f"st:{state}")
            members = await self._r.zrevrangebyscore(index, high, low, start=0, num=limit)
            return [r for r in await self._records(zone, members) if state is None or r.state == state]
        # Records written before the per-state sets existed are in none yet (the background
        # upgrade fills them): walk the zone's index and filter, a page at a time.
        found: list[Record] = []
        offset = 0
        while len(found) < limit:
            members = await self._r.zrevrangebyscore(
                _zone_key(zone, "idx"), high, low, start=offset, num=_PURGE_BATCH
            )
            found += [r for r in await self._records(zone, members) if r.state == state]
            if len(members) < _PURGE_BATCH:
                break
            offset += len(members)
        return found[:limit]

    async def _records(self, zone: str, members: list[Any]) -> list[Record]:
        async with self._r.pipeline(transaction=False) as pipe:
            for m in members:
                pipe.hget(_record_key(zone, str(m)), "d")
            datas = await pipe.execute()
        return [r for r in (_load(d if isinstance(d, str) else None) for d in datas) if r is not None]

    @_translated
    async def state_counts(self, zone: str) -> dict[str, int]:
        async with self._r.pipeline(transaction=False) as pipe:
            for st in State:
                pipe.zcard(_zone_key(zone, f"st:{st.value}"))
            counts = await pipe.execute()
        return {st.value: int(n) for st, n in zip(State, counts, strict=True) if n}

    @_translated
    async def audit_add(self, zone: str, entry: ZoneAudit) -> None:
        item = json.dumps(
            {
                "at": entry.at,
                "actor": entry.actor,
                "action": entry.action,
                "key": entry.key,
                "note": entry.note,
            },
            separators=(",", ":"),
        )
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.lpush(_zone_key(zone, "audit"), item)
            pipe.ltrim(_zone_key(zone, "audit"), 0, _AUDIT_KEPT - 1)
            await pipe.execute()

    @_translated
    async def audit_log(self, zone: str, since: float, limit: int = 1000) -> list[ZoneAudit]:
        items = await self._r.lrange(_zone_key(zone, "audit"), 0, limit - 1)
        entries = [ZoneAudit(**json.loads(item)) for item in items]
        return [e for e in entries if e.at >= since]

    async def _list_states(self, zone: str) -> None:
        # By score, a page per round trip (a zone of a million records outlasts any one
        # operation's deadline): the purge taking old members or writes moving members to
        # the top never shift the cursor, and a record rewritten meanwhile is met again
        # at its new score, which is harmless.
        score, offset = "-inf", 0
        while True:
            found = await self._list_states_page(zone, score, offset)
            if not found:
                return
            last, same = found
            score, offset = (last, offset + same) if last == score else (last, same)

    @_translated
    async def _list_states_page(self, zone: str, score: str, offset: int) -> tuple[str, int] | None:
        reply = await self._eval(self._states_page, [_zone_key(zone, "idx")], [score, offset, _PURGE_BATCH])
        if not reply:
            return None
        return str(reply[0]), int(reply[1])

    # --- provider health ---------------------------------------------------------------------
    @_translated
    async def set_circuit(self, instance: str, provider: str, circuit: str, now: float) -> None:
        field = json.dumps([instance, provider])
        await self._r.hset(_CIRCUITS, field, json.dumps([circuit, now]))

    @_translated
    async def circuits(self) -> list[CircuitState]:
        entries = await self._r.hgetall(_CIRCUITS)
        out = []
        for field, value in entries.items():
            instance, provider = json.loads(field)
            circuit, at = json.loads(value)
            out.append(CircuitState(str(instance), str(provider), str(circuit), float(at)))
        return sorted(out, key=lambda c: (c.provider, c.instance))

    @_translated
    async def set_probe(self, instance: str, provider: str, ready: bool, detail: str, now: float) -> None:
        field = json.dumps([instance, provider])
        await self._r.hset(_PROBES, field, json.dumps([ready, detail, now]))

    @_translated
    async def probes(self) -> list[ProbeState]:
        entries = await self._r.hgetall(_PROBES)
        out = []
        for field, value in entries.items():
            instance, provider = json.loads(field)
            ready, detail, at = json.loads(value)
            out.append(ProbeState(str(instance), str(provider), bool(ready), str(detail), float(at)))
        return sorted(out, key=lambda c: (c.provider, c.instance))

    # --- provider throttling -----------------------------------------------------------------
    @_translated
    async def rate_slot(self, provider: str, interval: float, max_wait: float, now: float) -> Slot:
        granted, wait = await self._eval(
            self._rate_slot, [_rate_key(provider)], [repr(now), repr(interval), repr(max_wait)]
        )
        # The stored arrival time stays in Redis; the caller needs only the decision.
        return Slot(bool(int(granted)), float(wait), 0.0)

    @_translated
    async def set_throttled(self, provider: str, until: float) -> None:
        await self._eval(self._throttle, [_THROTTLES], [provider, repr(until)])

    @_translated
    async def throttled(self, now: float) -> dict[str, float]:
        entries = await self._r.hgetall(_THROTTLES)
        return {str(p): float(u) for p, u in entries.items() if float(u) > now}

    @_translated
    async def hold_connection(self, provider: str, holder: str, limit: int, until: float, now: float) -> bool:
        got = await self._eval(
            self._hold_connection, [_connections_key(provider)], [repr(now), holder, repr(until), limit]
        )
        return bool(int(got))

    @_translated
    async def drop_connection(self, provider: str, holder: str) -> None:
        await self._r.zrem(_connections_key(provider), holder)

    # --- AUTH brute force --------------------------------------------------------------------
    @_translated
    async def auth_failure(self, ip: str, now: float, window: float) -> int:
        key = _auth_key(ip)
        keep = max(window, _WINDOW_KEEP)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.zadd(key, {f"{now!r}:{secrets.token_hex(8)}": now})
            pipe.zremrangebyscore(key, "-inf", f"({now - keep!r}")
            pipe.expire(key, math.ceil(keep))
            pipe.zcount(key, f"({now - window!r}", "+inf")
            *_, count = await pipe.execute()
        return int(count)

    @_translated
    async def auth_failures(self, ip: str, now: float, window: float) -> int:
        return int(await self._r.zcount(_auth_key(ip), f"({now - window!r}", "+inf"))


def _plan(due: list[list[tuple[float, str, str]]], counts: list[int], total: int) -> dict[str, list[int]]:
    """How many entries each zone gives from each lane: the SQLite backend's choice (each
    lane's quota of the oldest due, then the rest of the total from the lanes in order) made
    over the (due, zone, key) entries peeked from every zone."""
    for entries in due:
        entries.sort()
    taken = [min(n, len(entries)) for n, entries in zip(counts, due, strict=True)]
    room = total - sum(taken)
    for li, entries in enumerate(due):
        if room <= 0:
            break
        more = min(room, len(entries) - taken[li])
        taken[li] += more
        room -= more
    plan: dict[str, list[int]] = {}
    for li, entries in enumerate(due):
        for _, zone, _ in entries[: taken[li]]:
            plan.setdefault(zone, [0] * len(counts))[li] += 1
    return plan
