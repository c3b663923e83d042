"""/readyz on a shared store that answers but would refuse every write (DESIGN.md §18): a
Redis replica (READONLY) and a PostgreSQL hot standby answer their PING or SELECT 1, so the
probe also asks whether the server takes writes, in the same round trip: `store refuses
writes: …` (503) rather than `ready` while every submission gets 451 4.3.0. Real servers:
a redis-server turned replica and back, a streaming standby made by pg_basebackup."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest
import redis

from smtpguard.store import store_from_url
from tests.store.test_postgres_failover import pair
from tests.support import RedisServer
from tests.support.postgres import PostgresServer


async def test_a_redis_replica_is_not_ready_and_a_master_again_is(tmp: Path) -> None:
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    server, master = RedisServer(tmp / "a"), RedisServer(tmp / "b")
    server.start()
    master.start()
    store = store_from_url(server.url)
    admin = redis.Redis(port=server.port, decode_responses=True)
    try:
        await store.open()
        ready = await store.unready()
        admin.replicaof("127.0.0.1", master.port)
        replica = await store.unready()
        with pytest.raises(redis.ReadOnlyError):
            admin.set("sg:probe", "1")  # the situation is real: writes answer READONLY
        pinged = await store.ping()
        admin.replicaof("NO", "ONE")
        again = await store.unready()
    finally:
        await store.close()
        admin.close()
        server.stop()
        master.stop()
    print(f"master: {ready}; replica: {replica}; master again: {again}")
    assert ready is None and again is None
    assert replica == f"store refuses writes: redis is a replica of 127.0.0.1 {master.port} (replicaof)"
    assert pinged is True  # it still answers: ping is not readiness


def replayed(primary: PostgresServer, standby: PostgresServer, timeout: float = 30) -> None:
    """Until the standby has replayed all the WAL the primary has written now."""
    with psycopg.connect(primary.url, autocommit=True) as conn:
        lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert lsn is not None
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(standby.url, autocommit=True) as conn:
            row = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn[0],)).fetchone()
        if row is not None and row[0]:
            return
        assert time.monotonic() < deadline, f"the standby did not replay the primary's WAL to {lsn[0]}"
        time.sleep(0.05)


async def test_a_postgres_standby_is_not_ready_and_its_primary_is() -> None:
    with pair(synchronous=False) as (primary, standby):
        on_primary = store_from_url(primary.url)
        await on_primary.open()  # migrates; the standby replays the schema
        # Asynchronous replication: until the standby has replayed the primary's WAL, the
        # schema is not there and opening would try (and fail) to migrate a standby.
        replayed(primary, standby)
        on_standby = store_from_url(standby.url)
        try:
            await on_standby.open()
            got = (await on_primary.unready(), await on_standby.unready(), await on_standby.ping())
        finally:
            await on_standby.close()
            await on_primary.close()
    print(f"primary, standby, standby answers: {got}")
    standby_refuses = "store refuses writes: postgresql: the server is a standby (pg_is_in_recovery)"
    assert got == (None, standby_refuses, True)
