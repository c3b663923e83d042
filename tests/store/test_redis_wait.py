"""store.wait (WAIT for N replicas after each ledger write) and Sentinel URLs, on a real
redis-server: with fewer replicas than asked the write is refused (451 4.3.0 upstream of
any byte); with the replica there, writes go through. Config refuses store.wait where it
means nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from smtpguard.config import ConfigError, loads
from smtpguard.store import Reserved, StoreUnavailable, store_from_url
from smtpguard.store.redis import RedisStore, parse_sentinel_url
from tests.store.test_store_contract import fresh
from tests.support import RedisServer, Upstream, base_config, message, running_guard, send
from tests.support.eventually import eventually


async def test_wait_without_enough_replicas_refuses_the_write(redis_server: RedisServer) -> None:
    s = store_from_url(redis_server.url, wait=(1, 0.05))
    await s.open()
    try:
        with pytest.raises(StoreUnavailable, match="0 of 1 replicas"):
            # WAIT with no timeout would block for ever: a hang guard, not a measure
            await asyncio.wait_for(s.reserve(fresh("w1", zone="waitzone"), None, None, False), 30)
        # Reads do not wait.
        assert await s.get("waitzone", "nope") is None
    finally:
        await s.close()


async def test_wait_with_a_replica_writes(tmp_path: Path, redis_server: RedisServer) -> None:
    replica = RedisServer(tmp_path)
    replica.start()
    try:
        import redis

        r = redis.Redis(port=replica.port)
        r.replicaof("127.0.0.1", redis_server.port)
        link = await eventually(
            lambda: r.info("replication").get("master_link_status"),
            lambda s: s == "up",
            timeout=10,
            interval=0.05,
        )
        assert link == "up", link
        r.close()
        s = RedisStore(redis_server.url, wait=(1, 1.0))
        await s.open()
        try:
            rec = fresh("w2", zone="waitzone")
            assert await s.reserve(rec, None, None, False) == Reserved()
            assert await s.get("waitzone", "w2") == rec
        finally:
            await s.close()
    finally:
        replica.stop()


async def test_a_guard_with_wait_and_no_replica_answers_451_and_sends_nothing(
    tmp: Path, upstream: Upstream, redis_server: RedisServer
) -> None:
    cfg = base_config(tmp, upstream.port, store__url=redis_server.url)
    cfg["store"].update(unsafe=True, wait={"replicas": 1, "timeout": "50ms"})
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("wait:none"))
    assert (reply.code, reply.text[:5]) == (451, "4.3.0")
    assert upstream.received == []


def test_wait_is_refused_for_stores_that_do_not_have_it(tmp: Path) -> None:
    for url in (f"sqlite:///{tmp / 'x.db'}", "postgresql://u@db/smtpguard"):
        cfg = base_config(tmp, 2525, store__url=url)
        cfg["store"]["wait"] = {"replicas": 1}
        with pytest.raises(ConfigError, match=r"store\.wait is for Redis"):
            loads(yaml.safe_dump(cfg))
    cfg = base_config(tmp, 2525, store__url="redis+sentinel://127.0.0.1:26379,h2:26380/sg/1")
    cfg["store"]["wait"] = {"replicas": 2, "timeout": "300ms"}
    wait = loads(yaml.safe_dump(cfg)).store.wait
    assert wait is not None and (wait.replicas, wait.timeout) == (2, 0.3)


def test_sentinel_urls_name_the_sentinels_the_master_and_the_database() -> None:
    assert parse_sentinel_url("redis+sentinel://127.0.0.1:26379,h2:26380/sg/1") == (
        [("127.0.0.1", 26379), ("h2", 26380)],
        "sg",
        1,
        None,
    )
    assert parse_sentinel_url("redis+sentinel://:p%40ss@h1/mymaster") == (
        [("h1", 26379)],
        "mymaster",
        0,
        "p@ss",
    )
    with pytest.raises(ValueError, match="no master name"):
        parse_sentinel_url("redis+sentinel://h1:26379")
