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
import json
import math
import secrets
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from smtpguard.policy.events import bare_message_id
from smtpguard.policy.ledger import Record
from smtpguard.policy.limits import HOUR, WINDOW_KEEP
from smtpguard.policy.senders import suppression_key
from smtpguard.store.base import (
    CapUsage,
    CircuitState,
    IdField,
    ProbeState,
    Slot,
    StoredEvent,
    StoreUnavailable,
)
from smtpguard.store.clock import OnServerClock, ServerClock
from smtpguard.store.redis import scripts as redis_scripts
from smtpguard.store.redis.claim import Claims
from smtpguard.store.redis.connection import (
    _MAX_CONNECTIONS,
    _SPARE,
    SENTINEL_SCHEME,
    _translated,
    parse_sentinel_url,
)
from smtpguard.store.redis.desk import Desk
from smtpguard.store.redis.keys import (
    _CIRCUITS,
    _ID_PREFIX,
    _PAUSED_CLASSES,
    _PROBES,
    _THROTTLES,
    _ZONES,
    _auth_key,
    _connections_key,
    _counts_key,
    _cursor_key,
    _event_ids_key,
    _events_key,
    _ids,
    _ids_key,
    _month_key,
    _nonce_key,
    _paused_key,
    _rate_key,
    _record_key,
    _sends_key,
    _supp_key,
    _supp_version_key,
    _user_month_key,
    _user_window_key,
    _zone_key,
)
from smtpguard.store.redis.ledger import Ledger, _dump, _load
from smtpguard.store.redis.suppression import Suppressions
from smtpguard.store.redis.upgrade import Upgrades

# Names other modules, tests and bench/ import from here (the module this package was).
__all__ = [
    "SENTINEL_SCHEME",
    "_MAX_CONNECTIONS",
    "_SPARE",
    "RedisStore",
    "_dump",
    "_ids",
    "_record_key",
    "_zone_key",
    "parse_sentinel_url",
]

# Every Lua script is a file in lua/ whose header gives its KEYS and ARGV; the parts several
# share (the CAS write, the zone's lookups, the user's cap unit) are in lua/lib/.
_RESERVE = redis_scripts.load("reserve")
_PUT = redis_scripts.load("put")
_REFUND = redis_scripts.load("refund")
_PURGE = redis_scripts.load("purge")
_CONSUME = redis_scripts.load("consume")

_ENQUEUE = redis_scripts.load("enqueue")
_REQUEUE = redis_scripts.load("requeue")
_PEEK = redis_scripts.load("peek")
_CLAIM = redis_scripts.load("claim")
_LANES_OF = redis_scripts.load("lanes_of")
_ENTRIES = redis_scripts.load("entries")
_APPLY_EVENT = redis_scripts.load("apply_event")
_ADVANCE_CURSOR = redis_scripts.load("advance_cursor")
_STATES_PAGE = redis_scripts.load("states_page")
_RATE_SLOT = redis_scripts.load("rate_slot")
_THROTTLE = redis_scripts.load("throttle")
_HOLD_CONNECTION = redis_scripts.load("hold_connection")


class RedisStore(OnServerClock, Ledger, Claims, Desk, Suppressions, Upgrades):
    def __init__(
        self,
        url: str,
        password: str | None = None,
        wait: tuple[int, float] | None = None,
    ) -> None:
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
        self._advance_cursor: AsyncScript | None = None
        self._states_page: AsyncScript | None = None
        self._rate_slot: AsyncScript | None = None
        self._throttle: AsyncScript | None = None
        self._hold_connection: AsyncScript | None = None
        self._zones_announced: dict[str, float] = {}
        self._spare: list[Any] = []
        """Connections _command keeps between its calls instead of returning them to the
        pool (see _command); at most _SPARE, so redis-py's own calls always find one."""
        self._queued_swept_at: float | None = None
        self._clock = ServerClock()
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
        client = self._connect()
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
        self._advance_cursor = client.register_script(_ADVANCE_CURSOR)
        self._states_page = client.register_script(_STATES_PAGE)
        self._rate_slot = client.register_script(_RATE_SLOT)
        self._throttle = client.register_script(_THROTTLE)
        self._hold_connection = client.register_script(_HOLD_CONNECTION)
        self._client = client
        # Down at start: the local clock until the first sample (see now()).
        with contextlib.suppress(StoreUnavailable):
            await self.sync_clock()
        self._clock_task = asyncio.create_task(self._clock.track(self.sync_clock))
        self._fold_task = asyncio.create_task(self._upgrade())

    async def close(self) -> None:
        for task in (self._clock_task, self._fold_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._clock_task = self._fold_task = None
        await self._disconnect()

    # --- the store's clock (DESIGN.md §11.5) --------------------------------------------------
    @_translated
    async def sync_clock(self) -> None:
        async def read() -> float:
            sec, usec = await self._r.time()
            return sec + usec / 1e6

        await self._clock.sample(read)

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

    # The ledger's writes and purge are in ledger.py, the queue's claim in claim.py, the
    # desk's and the queue's listings in desk.py, the suppression lists in suppression.py, the
    # set-once upgrades in upgrade.py.

    # --- zones -------------------------------------------------------------------------------
    @_translated
    async def set_paused(self, zone: str, paused: bool) -> None:
        if paused:
            await self._r.set(_paused_key(zone), "1")
        else:
            await self._r.delete(_paused_key(zone))

    @_translated
    async def is_paused(self, zone: str) -> bool:
        return bool(await self._r.exists(_paused_key(zone)))

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
                pipe.zcount(_user_window_key(zone, user), now - HOUR, "+inf")
                pipe.get(_user_month_key(zone, user, month))
            values = await pipe.execute()
        return {
            user: CapUsage(hour=int(values[2 * i]), month=int(values[2 * i + 1] or 0))
            for i, user in enumerate(usernames)
        }

    @_translated
    async def cap_usage(self, zone: str, now: float, month: str) -> CapUsage:
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.zcount(_sends_key(zone), now - HOUR, "+inf")
            pipe.get(_month_key(zone, month))
            hour, used = await pipe.execute()
        return CapUsage(hour=int(hour), month=int(used or 0))

    @_translated
    async def add_counts(self, zone: str, counts: dict[str, int]) -> None:
        if not counts:
            return
        key = _counts_key(zone)
        async with self._r.pipeline(transaction=True) as pipe:
            for name, n in counts.items():
                pipe.hincrby(key, name, n)
            await pipe.execute()

    @_translated
    async def counts(self, zone: str) -> dict[str, int]:
        values = await self._r.hgetall(_counts_key(zone))
        return {str(name): int(value) for name, value in values.items()}

    # --- provider events ---------------------------------------------------------------------
    @_translated
    async def find_records(self, field: IdField, value: str) -> list[Record]:
        wanted = bare_message_id(value) if field == "message_id" else value.strip()
        prefix, position = _ID_PREFIX[field]
        name = prefix + wanted
        zones = sorted(str(z) for z in await self._r.smembers(_ZONES))
        async with self._r.pipeline(transaction=False) as pipe:
            for zone in zones:
                pipe.hget(_ids_key(zone), name)
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
            _event_ids_key(zone),
            _events_key(zone, key),
            _supp_key(zone),
            _supp_version_key(zone),
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
        key = _nonce_key(name)
        ttl = max(1, math.ceil(until - self.now()))
        if await self._r.set(key, digest, nx=True, ex=ttl):
            return True
        return bool(await self._r.get(key) == digest)

    @_translated
    async def reconcile_cursor(self, name: str) -> float | None:
        value = await self._r.get(_cursor_key(name))
        return None if value is None else float(value)

    @_translated
    async def advance_reconcile_cursor(self, name: str, expected: float | None, new: float) -> bool:
        # repr round-trips a float exactly, so the stored text is what the reader compared.
        was = "" if expected is None else repr(expected)
        return bool(await self._eval(self._advance_cursor, [_cursor_key(name)], [was, repr(new)]))

    @_translated
    async def provider_events(self, zone: str, key: str) -> list[StoredEvent]:
        items = await self._r.lrange(_events_key(zone, key), 0, -1)
        return [StoredEvent.from_dict(json.loads(item)) for item in items]

    # --- provider health ---------------------------------------------------------------------
    @_translated
    async def set_circuit(self, instance: str, provider: str, circuit: str, now: float) -> None:
        await self._publish(_CIRCUITS, instance, provider, [circuit, now])

    @_translated
    async def circuits(self) -> list[CircuitState]:
        published = await self._published(_CIRCUITS)
        return [CircuitState(i, p, str(circuit), float(at)) for i, p, (circuit, at) in published]

    @_translated
    async def set_probe(self, instance: str, provider: str, ready: bool, detail: str, now: float) -> None:
        await self._publish(_PROBES, instance, provider, [ready, detail, now])

    @_translated
    async def probes(self) -> list[ProbeState]:
        published = await self._published(_PROBES)
        return [ProbeState(i, p, bool(r), str(detail), float(at)) for i, p, (r, detail, at) in published]

    async def _publish(self, key: str, instance: str, provider: str, values: list[Any]) -> None:
        """One instance's word on one provider, in a hash every instance writes to."""
        await self._r.hset(key, json.dumps([instance, provider]), json.dumps(values))

    async def _published(self, key: str) -> list[tuple[str, str, list[Any]]]:
        """Every instance's word in `key`, ordered by provider, then instance."""
        out = []
        for field, value in (await self._r.hgetall(key)).items():
            instance, provider = json.loads(field)
            out.append((str(instance), str(provider), json.loads(value)))
        return sorted(out, key=lambda e: (e[1], e[0]))

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
        keep = max(window, WINDOW_KEEP)
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
