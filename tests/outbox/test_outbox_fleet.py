"""The outbox when things break: serve killed with -9 mid-batch, two instances on one
table, the application's database restarted mid-batch. Each counts what the upstream got."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from smtpguard.outbox.reader import CONCURRENCY
from tests.support import GuardProcess, Upstream, eventually, free_port, running_guard, write_config
from tests.support.outbox import (
    app_database,
    insert,
    new_database,
    outbox_config,
    pair_configs,
    receipts,
    row,
)
from tests.support.postgres import PostgresServer


def _pending(found: dict[str, dict[str, object]]) -> list[str]:
    return [k for k, r in found.items() if r["state"] == "pending"]


@pytest.mark.slow
async def test_kill_9_mid_batch_then_restart_every_row_done_one_copy_per_key(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url, volume=True)
    port = free_port()
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    # Short leases, so the dead instance's claims and reservations come back within the test.
    cfg["event_key"].update({"lease": "2s", "inflight_wait": "1s", "min_retry_interval": "1s"})
    cfg["queue"] = {"backoff": {"base": "1s", "max": "2s"}}
    path = write_config(tmp / "smtpguard.yaml", cfg)
    keys = [f"bulk:{i}" for i in range(500)]
    await insert(url, [row(k) for k in keys])
    first = GuardProcess(path, tmp / "first.log")
    first.start()
    try:
        await first.wait_port(port)
        await upstream.wait_received(100, timeout=30)
    finally:
        first.kill()
    at_kill = len(upstream.received)
    assert at_kill < 500, "the whole backlog went before the kill: nothing was tested"
    second = GuardProcess(path, tmp / "second.log")
    second.start()
    try:
        await second.wait_port(port)
        found = await eventually(lambda: receipts(url), lambda f: not _pending(f), timeout=30, interval=0.2)
    finally:
        await second.astop()
    assert not _pending(found), f"{len(_pending(found))} rows still pending"
    copies = Counter(upstream.event_keys())
    assert max(copies.values()) == 1, [k for k, n in copies.items() if n > 1]
    states = Counter(r["state"] for r in found.values())
    # Held: the final dot was out when the process died (the ledger's `unknown`): at most the
    # submissions under way at that instant, never resent.
    assert states["held"] <= CONCURRENCY, states
    assert set(states) <= {"sent", "duplicate", "held"}, states
    for k, r in found.items():
        if r["state"] in ("sent", "duplicate"):
            assert copies[k] == 1, (k, r)
    assert len(copies) >= 500 - states["held"]


async def test_two_instances_on_one_outbox_send_each_key_once(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    store = new_database(postgres_server, "store")
    configs = pair_configs(tmp, upstream.port, url, store, volume=True, batch=5)
    keys = [f"fleet:{i}" for i in range(200)]
    async with running_guard(configs[0]) as a, running_guard(configs[1]) as b:
        await insert(url, [row(k) for k in keys])
        found = await eventually(
            lambda: receipts(url),
            lambda f: all(r["state"] not in ("pending", "held") for r in f.values()),
            timeout=30,
            interval=0.1,
        )
        shares = (a.outbox[0].counters.rows, b.outbox[0].counters.rows)
    assert Counter(r["state"] for r in found.values()) == {"sent": 200}
    assert Counter(upstream.event_keys()) == Counter(keys)
    assert all(shares), shares  # both instances claimed rows: the table really was shared
    assert sum(shares) == 200, shares  # SKIP LOCKED: no row claimed by both


@pytest.mark.slow
async def test_the_application_database_restarted_mid_batch(tmp: Path, upstream: Upstream) -> None:
    pg = PostgresServer(name="app")
    pg.init()
    pg.start()
    try:
        url = app_database(pg)
        keys = [f"restart:{i}" for i in range(300)]
        await insert(url, [row(k) for k in keys])
        async with running_guard(outbox_config(tmp, upstream.port, url, volume=True, batch=50)) as server:
            reader = server.outbox[0]
            await upstream.wait_received(30, timeout=20)
            await asyncio.to_thread(pg.stop)
            await eventually(lambda: reader.counters.outages, lambda n: n >= 1, timeout=10, interval=0.05)
            sent_while_away = len(upstream.received)
            await asyncio.to_thread(pg.start)
            found = await eventually(
                lambda: receipts(url), lambda f: not _pending(f), timeout=30, interval=0.2
            )
            assert reader.counters.reconnects >= 2
    finally:
        pg.remove()
    assert Counter(upstream.event_keys()) == Counter(keys)
    states = Counter(r["state"] for r in found.values())
    # The batch under way when the database went was sent; its receipts waited and were
    # written once it was back, so every row reads `sent`, none `duplicate`.
    assert states == {"sent": 300}, states
    assert sent_while_away >= 30


@pytest.mark.slow
async def test_kill_9_of_one_of_two_instances_mid_batch_the_other_finishes_one_copy_per_key(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    store = new_database(postgres_server, "store")
    configs = pair_configs(tmp, upstream.port, url, store, volume=True, batch=50)
    for cfg in configs:
        # Short leases: the dead instance's claims and reservations come back within the test.
        cfg["event_key"].update({"lease": "2s", "inflight_wait": "1s", "min_retry_interval": "1s"})
        cfg["queue"] = {"backoff": {"base": "1s", "max": "2s"}}
    port = free_port()
    configs[0]["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    path = write_config(tmp / "a.yaml", configs[0])
    keys = [f"pair:{i}" for i in range(400)]
    a = GuardProcess(path, tmp / "a.log")
    a.start()
    try:
        await a.wait_port(port)
        async with running_guard(configs[1]) as b:
            await insert(url, [row(k) for k in keys])
            await upstream.wait_received(60, timeout=30)
            a.kill()
            found = await eventually(
                lambda: receipts(url), lambda f: not _pending(f), timeout=40, interval=0.2
            )
            b_rows = b.outbox[0].counters.rows
    finally:
        a.kill()
    assert not _pending(found), f"{len(_pending(found))} rows still pending"
    copies = Counter(upstream.event_keys())
    assert max(copies.values()) == 1, [k for k, n in copies.items() if n > 1]
    states = Counter(r["state"] for r in found.values())
    assert set(states) <= {"sent", "duplicate", "held"}, states
    # Held: the final dot of the dead instance's submissions under way when it died.
    assert states["held"] <= CONCURRENCY, states
    assert len(copies) >= len(keys) - states["held"]
    assert b_rows > 0
