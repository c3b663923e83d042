"""The Redis store's connection path: the pool (or Sentinel's master), the hand-rolled
command path with its kept connections, and the translator every operation goes through."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
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
from redis.maint_notifications import MaintNotificationsConfig

from smtpguard.store.base import StoreUnavailable
from smtpguard.store.clock import ServerClock
from smtpguard.store.errors import Probed, translated
from smtpguard.store.redis.keys import (
    _QUEUED_ZONES,
    _ZONES,
)

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
_PURGE_BATCH = 500
"""Members one round trip reads or rewrites (purge, listings, upgrades)."""

_translated = translated(RedisError, OSError, backend="redis", timeout=lambda: _TIMEOUT)
"""The one place a redis error becomes StoreUnavailable (451 4.3.0, nothing relayed), and
where an operation gets its deadline (store/errors.py)."""


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


class RedisConnection(Probed):
    """What every part of RedisStore stands on; RedisStore.__init__ sets these."""

    url: str
    _clock: ServerClock
    """The store's clock (OnServerClock): what claims and leases are written on."""
    _password: str | None
    _wait: bytes
    _wait_replicas: int
    _client: Redis | None
    _spare: list[Any]
    _sentinels: list[Redis]
    _reserve: AsyncScript | None
    _put: AsyncScript | None
    _refund: AsyncScript | None
    _purge: AsyncScript | None
    _consume: AsyncScript | None
    _enqueue: AsyncScript | None
    _requeue: AsyncScript | None
    _peek: AsyncScript | None
    _claim: AsyncScript | None
    _entries: AsyncScript | None
    _lanes_of: AsyncScript | None
    _apply_event: AsyncScript | None
    _states_page: AsyncScript | None
    _rate_slot: AsyncScript | None
    _throttle: AsyncScript | None
    _hold_connection: AsyncScript | None

    def _connect(self) -> Redis:
        """The client: its pool, or the Sentinel's master for a redis+sentinel:// URL."""
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
            # Off: while maintenance notifications (a managed-Redis feature) are on, and their
            # default "auto" counts as on, the pool skips its checkout check and hands out
            # connections the server has closed (after a Redis restart, every idle one), so
            # a write's one retry could be spent on a second dead connection.
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }
        if self.url.startswith(SENTINEL_SCHEME):
            return self._sentinel_client(options)
        options.update(parse_url(self.url))
        if self._password is not None:
            options["password"] = self._password
        return Redis.from_pool(BlockingConnectionPool(**options))

    async def _disconnect(self) -> None:
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
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8
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

    @_translated
    async def _refusal(self) -> str | None:
        """Whether the server is a replica (writes answer READONLY, or are dropped at the
        next sync with `replica-read-only no`), in the round trip a PING took. CONFIG GET,
        as durability_problems reads (the ACL of docs/redis.md allows `config|get`; ROLE
        and INFO are @dangerous). A server that refuses CONFIG answered: ready."""
        try:
            got = await self._r.config_get("replicaof")
        except ResponseError:
            return None
        master = str(got.get("replicaof") or "")
        return f"redis is a replica of {master} (replicaof)" if master else None

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

    @_translated
    async def _smembers(self, key: str) -> list[str]:
        return [str(m) for m in await self._r.smembers(key)]

    @_translated
    async def _known_zones(self) -> list[str]:
        return sorted(str(z) for z in await self._r.smembers(_ZONES))

    @_translated
    async def _add_queued_zone(self, zone: str) -> None:
        await self._r.sadd(_QUEUED_ZONES, zone)

    @_translated
    async def _flag_get(self, flag: str) -> bool:
        return bool(await self._r.exists(flag))

    @_translated
    async def _flag_set(self, flag: str) -> None:
        await self._r.set(flag, "1")
