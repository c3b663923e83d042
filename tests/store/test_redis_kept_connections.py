"""RedisStore._command keeps the connections of its ledger writes for the next write instead
of returning them to redis-py's pool (DESIGN.md §15): a kept connection skips the pool's
checkout check (is the socket still open, is this still the master). These tests make every
kept connection stale — Redis restarted, a Sentinel failover — and count the ledger writes
that fail afterwards (none may: one retry on a fresh connection is what a write gets), and
cancel a write halfway through to check the cancellation is not turned into a retried write.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from smtpguard.policy.ledger import Record
from smtpguard.store import Reserved, StoreUnavailable
from smtpguard.store.redis import _MAX_CONNECTIONS, _SPARE, RedisStore
from tests.store.test_redis_sentinel import Node, replicas_online
from tests.store.test_store_contract import fresh
from tests.support import RedisServer
from tests.support.eventually import eventually


async def _fill_kept(store: RedisStore, zone: str, n: int = 3 * _SPARE) -> None:
    """n concurrent ledger writes, so that _SPARE connections are kept when they are done."""
    # The set-once upgrades started at open first: while under way they hold a connection
    # (the 65th of a full pool) and their scripts take a kept one through _command.
    assert store._fold_task is not None
    await asyncio.wait_for(store._fold_task, 10)
    results = await asyncio.gather(
        *(store.reserve(fresh(f"fill{i}", zone=zone), None, None, False) for i in range(n))
    )
    assert results == [Reserved()] * n
    assert len(store._spare) == _SPARE  # the premise: every kept slot holds a connection


@contextlib.asynccontextmanager
async def stale_after_a_restart(tmp_path: Path, zone: str) -> AsyncIterator[tuple[RedisServer, RedisStore]]:
    """A store with _SPARE kept connections and the pool's idle ones, all made stale by a
    Redis restart (same port, empty: every connection now has a closed peer)."""
    server = RedisServer(tmp_path)
    server.start()
    store = RedisStore(server.url)
    await store.open()
    try:
        await _fill_kept(store, zone)  # 16 kept, 32 idle in the pool: all of them live
        server.stop()
        server.start()
        yield server, store
    finally:
        await store.close()
        server.stop()


async def _count_failures(store: RedisStore, zone: str, n: int) -> list[str]:
    """n ledger writes one after the other; the errors of those that failed."""
    failed: list[str] = []
    for i in range(n):
        try:
            assert await store.reserve(fresh(f"after{i}", zone=zone), None, None, False) == Reserved()
        except StoreUnavailable as e:
            failed.append(str(e))
    return failed


async def test_writes_after_a_redis_restart_do_not_fail_on_kept_connections(tmp_path: Path) -> None:
    async with stale_after_a_restart(tmp_path, "keptrestart") as (_, store):
        failed = await _count_failures(store, "keptrestart", 2 * _SPARE)
        assert failed == []
        for i in range(2 * _SPARE):
            assert await store.get("keptrestart", f"after{i}") is not None


async def test_writes_arriving_while_one_retries_after_a_redis_restart_all_succeed(tmp_path: Path) -> None:
    """An instance's first submissions after a restart: the first write's kept connection is
    stale, so it drops the kept ones to the pool and retries 50 ms later on one from the
    pool; the writes that arrive meanwhile take the dropped (reconnecting) ones, which leaves
    the pool's idle connections, closed by the old server too, for the retry. The pool must
    not hand out one of those as live (redis-py 8 skips its checkout check while maintenance
    notifications are on, and their default "auto" counts as on)."""
    async with stale_after_a_restart(tmp_path, "keptwave") as (_, store):
        first = asyncio.create_task(store.reserve(fresh("first", zone="keptwave"), None, None, False))
        # The first write is done, or it has met a stale kept connection and dropped them all.
        await eventually(lambda: first.done() or not store._spare, timeout=5, interval=0.001)
        wave = await asyncio.gather(
            *(store.reserve(fresh(f"wave{i}", zone="keptwave"), None, None, False) for i in range(_SPARE)),
            return_exceptions=True,
        )
        results = [*await asyncio.gather(first, return_exceptions=True), *wave]
        assert [str(r) for r in results if r != Reserved()] == []
        for key in ["first", *(f"wave{i}" for i in range(_SPARE))]:
            assert await store.get("keptwave", key) is not None


async def _planned_failover(probe: redis.Redis, deadline: float) -> None:
    """SENTINEL FAILOVER, asked again while Sentinel finds no replica suitable. It lists a
    replica as soon as the master's INFO names it, but promotes one only once its own link to
    it is up and has answered INFO and PING: until then (a loaded machine, seen on a fresh
    clone's run) the failover is refused NOGOODSLAVE."""
    while True:
        try:
            probe.execute_command("SENTINEL", "FAILOVER", "sg")
            return
        except redis.ResponseError as e:
            if "NOGOODSLAVE" not in str(e) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_writes_after_a_sentinel_failover_do_not_fail_on_kept_connections(tmp_path: Path) -> None:
    """SENTINEL FAILOVER (a planned switch, the old master stays up and becomes a replica):
    every kept connection points at the old master."""
    nodes: list[Node] = []
    store: RedisStore | None = None
    try:
        master = Node(tmp_path, "master")
        nodes.append(master)
        replica = Node(tmp_path, "replica", "--replicaof", "127.0.0.1", str(master.port))
        nodes.append(replica)
        deadline = time.monotonic() + 10
        while replicas_online(master.port) < 1:
            assert time.monotonic() < deadline, "replica did not sync"
            await asyncio.sleep(0.1)
        sentinel = Node(
            tmp_path,
            "sentinel",
            f"sentinel monitor sg 127.0.0.1 {master.port} 1",
            "sentinel down-after-milliseconds sg 1000",
            "sentinel failover-timeout sg 5000",
            sentinel=True,
        )
        nodes.append(sentinel)
        probe = redis.Redis(port=sentinel.port, socket_timeout=1, decode_responses=True)
        try:
            while not probe.sentinel_slaves("sg"):
                assert time.monotonic() < deadline + 10, "sentinel did not see the replica"
                await asyncio.sleep(0.1)
            store = RedisStore(f"redis+sentinel://127.0.0.1:{sentinel.port}/sg/0")
            await store.open()
            await _fill_kept(store, "keptfailover")
            await _planned_failover(probe, deadline + 30)
            while int(probe.sentinel_get_master_addr_by_name("sg")[1]) != replica.port:
                assert time.monotonic() < deadline + 30, "sentinel did not fail over"
                await asyncio.sleep(0.05)
        finally:
            probe.close()
        old = redis.Redis(port=master.port, socket_timeout=1, decode_responses=True)
        try:
            while old.info("replication")["role"] != "slave":
                assert time.monotonic() < deadline + 40, "the old master was not demoted"
                await asyncio.sleep(0.05)
        finally:
            old.close()
        failed = await _count_failures(store, "keptfailover", 2 * _SPARE)
        assert failed == []
        new = redis.Redis(port=replica.port, socket_timeout=1)
        try:
            assert new.info("replication")["role"] == "master"
        finally:
            new.close()
        for i in range(2 * _SPARE):
            assert await store.get("keptfailover", f"after{i}") is not None
    finally:
        if store is not None:
            await store.close()
        for node in reversed(nodes):
            node.stop()


async def test_kept_connections_do_not_take_the_pools_connections(tmp_path: Path) -> None:
    """A Sentinel pool refuses a connection past its limit instead of waiting: the idle kept
    connections must not count against the _MAX_CONNECTIONS that redis-py's own calls (reads,
    SCRIPT LOAD after a NOSCRIPT) may hold at once."""
    nodes: list[Node] = []
    store: RedisStore | None = None
    try:
        master = Node(tmp_path, "master")
        nodes.append(master)
        sentinel = Node(tmp_path, "sentinel", f"sentinel monitor sg 127.0.0.1 {master.port} 1", sentinel=True)
        nodes.append(sentinel)
        store = RedisStore(f"redis+sentinel://127.0.0.1:{sentinel.port}/sg/0")
        await store.open()
        await _fill_kept(store, "keptlimit")  # 16 kept connections, idle
        reads = await asyncio.gather(
            *(store.get("keptlimit", f"fill{i % (3 * _SPARE)}") for i in range(_MAX_CONNECTIONS)),
            return_exceptions=True,
        )
        assert [r for r in reads if not isinstance(r, Record)] == []
    finally:
        if store is not None:
            await store.close()
        for node in reversed(nodes):
            node.stop()


async def test_a_write_cancelled_before_its_reply_is_not_retried(redis_server: RedisServer) -> None:
    """With store.wait, a write cancelled while it waits for the script's reply (Redis is
    paused) must end cancelled: not read WAIT's reply from the dropped connection, take that
    for a dead connection and send the script again (a timed-out script may have run)."""
    store = RedisStore(redis_server.url, wait=(1, 0.05))
    await store.open()
    admin = redis.Redis(port=redis_server.port)
    try:
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
            await store.reserve(fresh("warm", zone="keptcancel"), None, None, False)  # a kept connection
        # Paused until the test lifts it: a write that waited the pause out (and tried again)
        # would still be waiting when the bound below runs out.
        admin.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
        task = asyncio.create_task(store.reserve(fresh("cancelled", zone="keptcancel"), None, None, False))

        def blocked() -> int:
            return int(admin.info("clients")["blocked_clients"])

        # The script is at Redis, held by the pause: the write now waits for its reply.
        assert await eventually(blocked, lambda n: n == 1, timeout=5, interval=0.01) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)  # ended while Redis is still paused
        admin.execute_command("CLIENT", "UNPAUSE")
        # Nothing is held any more: what Redis received has run (or went with its connection).
        assert await eventually(blocked, lambda n: n == 0, timeout=5, interval=0.01) == 0
        # The script ran at most once: the reservation holds the cancelled write's attempt.
        got = await store.get("keptcancel", "cancelled")
        assert got is None or got.sg_id == "att:cancelled"
        # The next write on this store gets its own reply.
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
            await store.reserve(fresh("next", zone="keptcancel"), None, None, False)
        assert (await store.get("keptcancel", "next")) is not None
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        await store.close()
