"""The PostgreSQL store beyond the contract suite (DESIGN.md §15): two `smtpguard serve`
processes on one real PostgreSQL send each key once and keep caps exact (counted at a
recording upstream); an unreachable server is a quick 451 and a returning one is used
without a restart; the durability check names the settings; the clock is the server's."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from smtpguard.config import loads
from smtpguard.store import StoreUnavailable, store_from_url
from smtpguard.store.postgres import PostgresStore
from tests.store.test_store_contract import fresh
from tests.support import (
    Behaviour,
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    message,
    send,
    write_config,
)
from tests.support.postgres import PostgresServer


def database(server: PostgresServer) -> str:
    """A new, empty database on the session's server: the URL of it."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.url.rsplit("/", 1)[0] + f"/{name}"


@contextlib.asynccontextmanager
async def two_instances(
    tmp: Path, upstream: Upstream, url: str, **overrides: Any
) -> AsyncIterator[list[int]]:
    guards: list[GuardProcess] = []
    ports: list[int] = []
    try:
        for name in ("a", "b"):
            port = free_port()
            cfg = base_config(tmp, upstream.port, instance=name, store__url=url, **overrides)
            cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
            guard = GuardProcess(write_config(tmp / f"{name}.yaml", cfg), tmp / f"{name}.log")
            guard.start()
            guards.append(guard)
            ports.append(port)
        for guard, port in zip(guards, ports, strict=True):
            await guard.wait_port(port)
        yield ports
    except BaseException:
        for guard in guards:
            print(f"--- {guard.log_path.name} ---\n{guard.log_path.read_text()[-3000:]}")
        raise
    finally:
        codes = await asyncio.gather(*(asyncio.to_thread(g.stop) for g in guards))
    assert codes == [0, 0], f"unclean stop: {codes}"


@pytest.mark.slow
async def test_one_key_fifty_ways_across_two_instances_on_postgres_is_sent_once(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=0.3)
    url = database(postgres_server)
    async with two_instances(tmp, upstream, url) as ports:
        replies = await asyncio.gather(*(send(ports[i % 2], message("pg:one")) for i in range(50)))
        # And fifty distinct keys at once: each sent exactly once.
        many = await asyncio.gather(*(send(ports[i % 2], message(f"pg:k{i}")) for i in range(50)))
    codes = Counter(r.code for r in replies)
    print(
        f"postgres two instances: 50 concurrent submissions of one key → "
        f"{upstream.event_keys().count('pg:one')} upstream, replies {dict(codes)}, "
        f"{sum('duplicate' in r.text for r in replies)} duplicate; 50 distinct keys → "
        f"{sum(r.code == 250 for r in many)} x 250, {len(upstream.received)} upstream in all"
    )
    assert [r.code for r in replies] == [250] * 50, [str(r) for r in replies if r.code != 250]
    assert sum("duplicate" in r.text for r in replies) == 49
    assert [r.code for r in many] == [250] * 50
    assert Counter(upstream.event_keys()) == Counter(["pg:one", *(f"pg:k{i}" for i in range(50))])


@pytest.mark.slow
async def test_hourly_cap_is_exact_across_two_instances_on_postgres(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = database(postgres_server)
    async with two_instances(tmp, upstream, url, zones__acme__hourly_cap=10) as ports:
        replies = await asyncio.gather(*(send(ports[i % 2], message(f"pg:cap:{i}")) for i in range(50)))
    sent = sum(r.code == 250 for r in replies)
    capped = sum(r.code == 451 and r.text.startswith("4.7.0") for r in replies)
    print(f"postgres two instances: 50 keys, hourly_cap 10 → {sent} x 250, {capped} x 451 4.7.0, "
          f"{len(upstream.received)} upstream")  # fmt: skip
    assert sent == 10 and capped == 40
    accepted = {f"pg:cap:{i}" for i, r in enumerate(replies) if r.code == 250}
    assert Counter(upstream.event_keys()) == Counter(accepted)


async def test_postgres_unreachable_is_store_unavailable_and_quick() -> None:
    s = PostgresStore(f"postgresql://postgres@127.0.0.1:{free_port()}/postgres")
    await s.open()
    try:
        with pytest.raises(StoreUnavailable):
            # a hang guard, not a measure: a connect that waited for no one would hang here
            await asyncio.wait_for(s.reserve(fresh("k1"), None, None, False), 30)
        assert await s.ping() is False
    finally:
        await s.close()


async def test_postgres_store_started_before_its_server_recovers_without_restart() -> None:
    server = PostgresServer()
    server.init()
    s = PostgresStore(server.url)
    await s.open()  # nothing listens yet: opens anyway, answers 451 meanwhile
    try:
        with pytest.raises(StoreUnavailable):
            await s.get("acme", "k1")
        server.start()
        deadline = time.monotonic() + 20
        got: Any = None
        while time.monotonic() < deadline:
            try:
                got = await s.reserve(fresh("k1"), None, None, False)
                break
            except StoreUnavailable:
                await asyncio.sleep(0.2)
        assert got is not None, "the store never reached the server that came up"
        assert await s.get("acme", "k1") == fresh("k1")
        # A restart of the server (its connections die with it): used again, no restart here.
        server.stop()
        server.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                assert await s.get("acme", "k1") == fresh("k1")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "not back after the server restarted"
                await asyncio.sleep(0.2)
    finally:
        await s.close()
        server.remove()


async def test_postgres_durability_is_checked_setting_by_setting() -> None:
    server = PostgresServer()
    server.init()
    server.start()
    s = store_from_url(server.url)
    try:
        await s.open()
        assert await s.durability_problems() == []
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_commit = off")
            conn.execute("ALTER SYSTEM SET fsync = off")
            conn.execute("SELECT pg_reload_conf()")
        # A reload reaches new sessions; the pool's sessions see it at their next statement.
        deadline = time.monotonic() + 5
        while len(problems := await s.durability_problems()) < 2:
            assert time.monotonic() < deadline, problems
            await asyncio.sleep(0.1)
        assert any("fsync" in p and "'off'" in p for p in problems)
        assert any("synchronous_commit" in p for p in problems)
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_commit = local")
            conn.execute("ALTER SYSTEM SET fsync = on")
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 5
        while True:
            problems = await s.durability_problems()
            if any("failover" in p for p in problems):
                break
            assert time.monotonic() < deadline, problems
            await asyncio.sleep(0.1)
        assert len(problems) == 1
    finally:
        await s.close()
        server.remove()


async def test_postgres_clock_is_the_servers(postgres_server: PostgresServer) -> None:
    s = PostgresStore(postgres_server.url)
    await s.open()
    try:
        with psycopg.connect(postgres_server.url) as conn:
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        assert abs(s.now() - float(row[0])) < 0.05
        # This host's monotonic clock jumps ahead: the next sample never moves it backwards.
        real = s._mono
        s._mono = lambda: real() + 300.0
        ahead = s.now()
        await s.sync_clock()
        assert s.now() >= ahead
    finally:
        await s.close()


def test_postgres_urls_are_accepted_by_the_config(tmp: Path) -> None:
    for url in (
        "postgresql://smtpguard@db1:5432,db2:5432/smtpguard?target_session_attrs=read-write",
        "postgres://smtpguard@db/smtpguard",
    ):
        cfg = base_config(tmp, 2525, store__url=url)
        assert loads(yaml.safe_dump(cfg)).store.url == url


@pytest.mark.slow
async def test_store_and_forward_across_two_instances_on_postgres_delivers_each_event_once(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    """Both instances accept into one PostgreSQL queue and both workers claim from it
    (SKIP LOCKED): every event reaches the upstream once, whoever accepted or delivered it."""
    upstream.handler.default = Behaviour(hang_after_dot=0.05)
    url = database(postgres_server)
    overrides: dict[str, Any] = {
        "zones__acme__delivery": "queue",
        "zones__acme__hourly_cap": 100_000,
        "zones__acme__monthly_cap": 1_000_000,
        "event_key__lease": "2s",
        "queue": {"backoff": {"base": "200ms", "max": "1s"}, "workers": 4, "poll_interval": "100ms"},
    }
    n = 40
    async with two_instances(tmp, upstream, url, **overrides) as ports:
        accepted = await asyncio.gather(*(send(ports[i % 2], message(f"pg:q:{i}")) for i in range(n)))
        # Each event again, to the other instance: answered from the ledger, never queued twice.
        dups = await asyncio.gather(*(send(ports[(i + 1) % 2], message(f"pg:q:{i}")) for i in range(n)))
        await upstream.wait_received(n, timeout=30)
        store = PostgresStore(url)
        await store.open()
        try:
            deadline = time.monotonic() + 30
            while await store.queue_entries(None):
                assert time.monotonic() < deadline, await store.queue_entries(None)
                await asyncio.sleep(0.1)
            states = Counter(
                rec.state.value if rec else "missing"
                for rec in [await store.get("acme", f"pg:q:{i}") for i in range(n)]
            )
        finally:
            await store.close()
    print(
        f"postgres two instances, queue: {n} accepted → {len(upstream.received)} upstream, "
        f"{len(set(upstream.event_keys()))} distinct; states {dict(states)}"
    )
    assert [r.code for r in accepted] == [250] * n
    assert all(r.code == 250 and "duplicate" in r.text for r in dups), [str(r) for r in dups]
    assert Counter(upstream.event_keys()) == Counter(f"pg:q:{i}" for i in range(n))
    assert states == Counter({"delivered": n})


def test_a_multi_host_url_needs_read_write_sessions() -> None:
    import json

    from smtpguard.config import ConfigError, loads
    from tests.support import base_config

    cfg = base_config(Path("/tmp"), 2525, store__url="postgresql://a:5432,b:5432/sg")
    with pytest.raises(ConfigError, match="target_session_attrs=read-write"):
        loads(json.dumps(cfg))
    cfg["store"]["url"] += "?target_session_attrs=read-write"
    loads(json.dumps(cfg))
