"""Redis backend: several smtpguard instances sharing one ledger, caps and pause switches.

Durability you need from Redis (docs/redis.md has the full guide): a reservation counts once
Redis has replied, and one Redis then forgets lets the next retry be relayed again (a
duplicate). Run `appendonly yes` with `appendfsync always`, so the AOF is fsynced before the
reply. With `everysec` a crash of the Redis process loses nothing, but a kernel crash or
power loss loses the last ~1-2 s of acknowledged writes. Use `maxmemory-policy noeviction`:
records have no TTL, and an evicted record is a forgotten event. Replication is
asynchronous, so a failover can lose the writes a replica had not received; this backend
does not issue WAIT: prefer no automatic failover, or bound the window with
`min-replicas-to-write`.

Every key of a zone carries the hash tag `{zone}`, so each script touches one Cluster slot.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from smtpguard.policy.ledger import Record, State
from smtpguard.policy.limits import HOUR, CapCheck, CapReached
from smtpguard.policy.senders import normalize_address
from smtpguard.store.base import (
    CapUsage,
    Conflict,
    Paused,
    Reserved,
    ReserveResult,
    StoreUnavailable,
    Suppression,
)

P = ParamSpec("P")
T = TypeVar("T")

_TIMEOUT = 2.0
"""Deadline of one store operation, and of one connect."""
_HEALTH_CHECK_INTERVAL = 10
_MAX_CONNECTIONS = 64
_MONTH_TTL = 40 * 86400
# Window entries are kept as long as SQLite keeps them (its purge drops them after 2 h).
_WINDOW_KEEP = 2 * HOUR
_PURGE_BATCH = 500
# How often one process re-announces a zone in the zone set (it survives a Redis data loss).
_ZONE_ANNOUNCE_EVERY = 300.0
_ZONES = "sg:zones"
_SETTLED_EXCLUDED = (State.IN_FLIGHT.value, State.QUEUED.value)

# KEYS: record, paused, sends, month, index
# ARGV: expected version ('' = absent), forced pause, has cap, monthly cap, hourly cap,
#       hour start, token, now, trim before, month ttl, version, state, data, index score, key
_RESERVE = """
local cur = redis.call('HMGET', KEYS[1], 'v', 'd')
if ARGV[1] == '' then
  if cur[1] then return {'conflict', cur[2]} end
elseif cur[1] ~= ARGV[1] then
  return {'conflict', cur[2] or false}
end
if ARGV[2] == '1' or redis.call('EXISTS', KEYS[2]) == 1 then return {'paused'} end
if ARGV[3] == '1' then
  if tonumber(redis.call('GET', KEYS[4]) or '0') >= tonumber(ARGV[4]) then return {'month'} end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[9])
  if redis.call('ZCOUNT', KEYS[3], ARGV[6], '+inf') >= tonumber(ARGV[5]) then
    local oldest = redis.call('ZRANGEBYSCORE', KEYS[3], ARGV[6], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    return {'hour', oldest[2] or false}
  end
  redis.call('ZADD', KEYS[3], 'NX', ARGV[8], ARGV[7])
  redis.call('INCR', KEYS[4])
  redis.call('EXPIRE', KEYS[4], ARGV[10])
end
redis.call('HSET', KEYS[1], 'v', ARGV[11], 's', ARGV[12], 'd', ARGV[13])
redis.call('ZADD', KEYS[5], ARGV[14], ARGV[15])
return {'ok'}
"""

# KEYS: record, index.  ARGV: expected version ('' = absent), version, state, data, index
# score, key
_PUT = """
local cur = redis.call('HMGET', KEYS[1], 'v', 'd')
if ARGV[1] == '' then
  if cur[1] then return {'conflict', cur[2]} end
elseif cur[1] ~= ARGV[1] then
  return {'conflict', cur[2] or false}
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 's', ARGV[3], 'd', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
return {'ok'}
"""

# KEYS: sends, month.  ARGV: token.  Only a unit still recorded is returned: idempotent.
_REFUND = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  if tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
end
return 0
"""

# KEYS: index, record…  ARGV: cutoff, unsettled state…(2), key…
# Returns {deleted, kept}: kept counts old entries left in place (in_flight, queued).
_PURGE = """
local deleted, kept = 0, 0
local cutoff = tonumber(ARGV[1])
for i = 2, #KEYS do
  local member = ARGV[i + 2]
  local score = redis.call('ZSCORE', KEYS[1], member)
  if score and tonumber(score) < cutoff then
    local s = redis.call('HGET', KEYS[i], 's')
    if not s then
      redis.call('ZREM', KEYS[1], member)
    elseif s == ARGV[2] or s == ARGV[3] then
      kept = kept + 1
    else
      redis.call('DEL', KEYS[i])
      redis.call('ZREM', KEYS[1], member)
      deleted = deleted + 1
    end
  end
end
return {deleted, kept}
"""


def _zone_key(zone: str, name: str) -> str:
    return f"sg:{{{zone}}}:{name}"


def _record_key(zone: str, key: str) -> str:
    return _zone_key(zone, f"ev:{key}")


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


class RedisStore:
    def __init__(self, url: str, password: str | None = None) -> None:
        self.url = url
        self._password = password
        self._client: Redis | None = None
        self._reserve: AsyncScript | None = None
        self._put: AsyncScript | None = None
        self._refund: AsyncScript | None = None
        self._purge: AsyncScript | None = None
        self._zones_announced: dict[str, float] = {}

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
            "max_connections": _MAX_CONNECTIONS,
            "timeout": _TIMEOUT,
            "decode_responses": True,
            # One quick retry on a dead pooled connection (Redis restarted) and nothing on a
            # timeout: a timed-out script may have run, and running it twice counts twice.
            "retry": Retry(ExponentialBackoff(cap=0.2, base=0.05), 1, (RedisConnectionError,)),
        }
        options.update(parse_url(self.url))
        if self._password is not None:
            options["password"] = self._password
        client = Redis.from_pool(BlockingConnectionPool(**options))
        self._reserve = client.register_script(_RESERVE)
        self._put = client.register_script(_PUT)
        self._refund = client.register_script(_REFUND)
        self._purge = client.register_script(_PURGE)
        self._client = client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

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
        ]
        reply = await self._script(self._reserve)(keys, args)
        verdict = reply[0]
        if verdict == "ok":
            return Reserved()
        if verdict == "conflict":
            return Conflict(_load(reply[1]))
        if verdict == "paused":
            return Paused()
        assert cap is not None
        if verdict == "month":
            return CapReached("month", cap.caps.monthly)
        oldest = float(reply[1]) if reply[1] else None
        return CapReached("hour", cap.caps.hourly, (oldest or cap.now) + HOUR)

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
        ]
        reply = await self._script(self._put)(keys, args)
        if reply[0] == "ok":
            return None
        return Conflict(_load(reply[1]))

    @_translated
    async def refund(self, zone: str, token: str, month: str) -> None:
        keys = [_zone_key(zone, "sends"), _zone_key(zone, f"month:{month}")]
        await self._script(self._refund)(keys, [token])

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
        done, kept = await self._script(self._purge)(keys, [cutoff, *_SETTLED_EXCLUDED, *members])
        return int(done), int(kept)

    @_translated
    async def _trim_window(self, zone: str, before: float) -> None:
        await self._r.zremrangebyscore(_zone_key(zone, "sends"), "-inf", f"({before!r}")

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
        addr = normalize_address(address)
        # Two slots (the zone's and global's): a plain pipeline, one round trip, no MULTI.
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.hexists(_zone_key(zone, "supp"), addr)
            pipe.hexists(_zone_key("global", "supp"), addr)
            in_zone, in_global = await pipe.execute()
        if in_zone:
            return zone
        return "global" if in_global else None

    @_translated
    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        entry = json.dumps({"reason": reason, "at": now}, separators=(",", ":"))
        added = await self._r.hsetnx(_zone_key(zone, "supp"), normalize_address(address), entry)
        return bool(added)

    @_translated
    async def suppress_remove(self, zone: str, address: str) -> bool:
        return bool(await self._r.hdel(_zone_key(zone, "supp"), normalize_address(address)))

    @_translated
    async def suppress_list(self, zone: str) -> list[Suppression]:
        entries = await self._r.hgetall(_zone_key(zone, "supp"))
        result = []
        for address, raw in sorted(entries.items()):
            entry = json.loads(raw)
            result.append(Suppression(zone, str(address), str(entry["reason"]), float(entry["at"])))
        return result

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
