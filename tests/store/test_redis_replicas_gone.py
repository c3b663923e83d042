"""docs/redis.md, "Replicas, failover and WAIT": with fewer replicas left than the store
must wait for (`store.wait`) or than the master demands (`min-replicas-to-write`), every
write is refused: each new event answers 451 4.3.0 and nothing is sent (a duplicate of
a delivered one is still answered as a duplicate). Real redis-servers (a master and its
replica, stopped by pid), a real SMTP client, a recording upstream that counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import RedisServer, Upstream, base_config, message, running_guard, send


@pytest.fixture
def master(tmp: Path) -> Iterator[RedisServer]:
    (tmp / "master").mkdir()
    server = RedisServer(tmp / "master")
    server.start()
    yield server
    server.stop()


async def _replicas(client: redis.Redis, want: int) -> None:
    deadline = time.monotonic() + 10
    while int(client.info("replication")["connected_slaves"]) != want:
        assert time.monotonic() < deadline, f"the master never had {want} replicas"
        await asyncio.sleep(0.05)


async def test_wait_with_its_last_replica_gone_answers_451_to_every_submission(
    tmp: Path, upstream: Upstream, master: RedisServer
) -> None:
    (tmp / "replica").mkdir()
    replica = RedisServer(tmp / "replica")
    replica.start()
    admin = redis.Redis(port=master.port, decode_responses=True)
    try:
        link = redis.Redis(port=replica.port, decode_responses=True)
        link.replicaof("127.0.0.1", master.port)
        deadline = time.monotonic() + 10
        while link.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never synchronised"
            await asyncio.sleep(0.05)
        link.close()
        # The replica reads its link up before the master counts it as acknowledging: a WAIT
        # in between finds no replica (a loaded fresh clone answered the first three 451).
        # Ready when the master has one replica that acknowledges a write.
        await _replicas(admin, 1)
        admin.set("smtpguard-test:replicated", "1")
        assert admin.wait(1, 10_000) == 1, "the replica never acknowledged a write"
        cfg = base_config(tmp, upstream.port, store__url=master.url)
        # Well inside the store's 2 s deadline; long enough that a loaded machine's replica
        # acknowledges in time while it is there.
        cfg["store"].update(unsafe=True, wait={"replicas": 1, "timeout": "500ms"})
        async with running_guard(cfg) as guard:
            port = guard.ports[0]
            before = [await send(port, message(f"rep:{i}")) for i in range(3)]
            replica.stop()
            await _replicas(admin, 0)
            after = [await send(port, message(f"gone:{i}")) for i in range(5)]
            again = await send(port, message("rep:0"))
    finally:
        replica.stop()
        admin.close()
    print(f"replica gone: {[r.code for r in after]}; a delivered key again: {again.code} {again.text[:40]}")
    assert [r.code for r in before] == [250] * 3
    assert [(r.code, r.text[:5]) for r in after] == [(451, "4.3.0")] * 5
    assert upstream.event_keys() == ["rep:0", "rep:1", "rep:2"]
    # A duplicate of a delivered event needs no write: it is still answered as one.
    assert again.code == 250 and "duplicate" in again.text


async def test_min_replicas_to_write_with_none_answers_451_to_every_submission(
    tmp: Path, upstream: Upstream, master: RedisServer
) -> None:
    admin = redis.Redis(port=master.port, decode_responses=True)
    cfg = base_config(tmp, upstream.port, store__url=master.url, store__unsafe=True)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        delivered = await send(port, message("norep:first"))
        admin.config_set("min-replicas-to-write", 1)
        replies = [await send(port, message(f"norep:{i}")) for i in range(5)]
        again = await send(port, message("norep:first"))
    admin.close()
    print(f"min-replicas-to-write 1, none: {[r.code for r in replies]}; a delivered key again: {again.code}")
    assert delivered.code == 250
    assert [(r.code, r.text[:5]) for r in replies] == [(451, "4.3.0")] * 5
    assert upstream.event_keys() == ["norep:first"]
    # Settled before: answered as a duplicate without a write.
    assert again.code == 250 and "duplicate" in again.text
