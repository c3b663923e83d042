"""What the outbox's gauges cost the application's database. The rows per state were one
`GROUP BY state` over the whole table at every refresh, once a second: on a table of a
million rows (a month of receipts the docs advise keeping) that is a sequential scan of
868 MB taking 300 ms, every second, by every instance. The open states (pending, held, and
the lag) are read through the table's partial index at every refresh; the final ones, which
only a scan can count, at most once a minute on a table that large."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import psycopg

from tests.support import FakeClock, Upstream, eventually, free_port, running_guard
from tests.support.outbox import app_database, outbox_config
from tests.support.postgres import PostgresServer

RECEIPTS = 150_000


def _seq_scans(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'smtpguard_outbox'"
        ).fetchone()
    assert found is not None
    return int(found[0])


def _others_connected(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert found is not None
    return int(found[0])


async def test_a_large_table_is_not_scanned_whole_at_every_refresh_and_its_gauges_stay_right(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    with psycopg.connect(url, autocommit=True) as app:
        app.execute(
            "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, state, done_at) "
            "SELECT 'old:' || i, 'x', 'billing@acme.example', ARRAY['c@example.com'], 'sent', now() "
            f"FROM generate_series(1, {RECEIPTS}) AS i"
        )
        app.execute(
            "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, not_before) "
            "VALUES ('later:1', 'x', 'billing@acme.example', ARRAY['c@example.com'], "
            "now() + interval '1 day')"
        )
        app.execute("ANALYZE smtpguard_outbox")  # as autovacuum does for the application
    before = _seq_scans(url)
    clock = FakeClock()
    metrics_port = free_port()
    cfg = outbox_config(tmp, upstream.port, url, poll="1h")
    cfg["metrics"] = {"address": f"127.0.0.1:{metrics_port}"}
    refreshes = 10
    async with running_guard(cfg, clock=clock) as server, aiohttp.ClientSession() as http:
        reader = server.outbox[0]
        for _ in range(refreshes):
            passes = reader.counters.passes
            clock.t += 1.5  # past the refresh interval: this pass counts
            reader.wake()
            # The pass after the next one has begun: the next one's count is done.
            await eventually(
                lambda: reader.counters.passes, lambda n, p=passes: n >= p + 1, timeout=10, interval=0.02
            )
            reader.wake()
            await eventually(
                lambda: reader.counters.passes, lambda n, p=passes: n >= p + 2, timeout=10, interval=0.02
            )
        async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
            text = await r.text()
    assert f'smtpguard_outbox_rows{{source="shop",state="sent"}} {float(RECEIPTS)}' in text
    assert 'smtpguard_outbox_rows{source="shop",state="pending"} 1.0' in text
    # The reader's backends gone, their statistics are flushed: read them.
    await eventually(lambda: _others_connected(url), lambda n: n == 0, timeout=10, interval=0.05)
    scans = _seq_scans(url) - before
    print(f"{refreshes} refreshes of the counts on {RECEIPTS} rows: {scans} sequential scans")
    # The first refresh counts the whole table: one scan, counted once per process of a
    # parallel plan (a leader and up to two workers); every refresh did as much before.
    assert scans <= 3, scans
    assert upstream.received == []
