"""What one claim of the outbox reads: bounded in message octets as well as in rows, so a
backlog of large messages cannot take more memory than serve has. Against a real PostgreSQL,
counted at the recording upstream."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from tests.support import Upstream, eventually, running_guard
from tests.support.outbox import app_database, insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer

MIB = 1024 * 1024


async def test_a_backlog_of_large_messages_is_claimed_a_bounded_number_of_octets_at_a_time(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from smtpguard.outbox import rows
    from smtpguard.outbox.connection import connect

    # 30 rows of 3 MiB, each under the 25 MB default limit: one claim of batch 100 read all
    # 90 MiB, and peaked near three times that in serve (bytea arrives as hex text). With
    # the default batch of 100 rows near 25 MB, that was 7 GB: serve, SMTP included, ended,
    # and ended again at each restart on the same rows.
    url = app_database(postgres_server)
    keys = [f"pdf:{i}" for i in range(30)]
    pdf = (b"y" * 76 + b"\n") * (3 * MIB // 77)  # base64 lines, as an attachment is written
    await insert(url, [replace(row(k), message=row(k).message + pdf) for k in keys])
    async with await connect(url, None) as conn:
        now = time.time()
        # Claimed until now: every row is due again at once, for serve below.
        first = await rows.claim(conn, "smtpguard_outbox", now, now, 100, 25_000_000)
    read = sum(len(r.message) for r in first.rows)
    assert 0 < read <= 64 * MIB, (len(first.rows), read)
    assert len(first.rows) < len(keys) and first.more
    cfg = outbox_config(tmp, upstream.port, url, volume=True)
    async with running_guard(cfg) as server:
        found = await eventually(
            lambda: receipts(url),
            lambda f: all(r["state"] not in ("pending", "held") for r in f.values()),
            timeout=60,
            interval=0.1,
        )
        assert server.outbox[0].counters.rows == len(keys)
    assert Counter(r["state"] for r in found.values()) == {"sent": len(keys)}
    assert Counter(upstream.event_keys()) == Counter(keys)


async def test_a_message_larger_than_the_claim_bound_is_still_claimed_alone(
    postgres_server: PostgresServer,
) -> None:
    from smtpguard.outbox import rows
    from smtpguard.outbox.connection import connect

    # A limit above the bound (a site that sends 100 MB mail): such a row is claimed on its
    # own, first in its claim, never left behind for good by the bound.
    url = app_database(postgres_server)
    huge = row("huge:1").message + (b"z" * 76 + b"\n") * (70 * MIB // 77)
    await insert(url, [replace(row("huge:1"), message=huge)])
    await insert(url, [row("small:1")])
    async with await connect(url, None) as conn:
        now = time.time()
        first = await rows.claim(conn, "smtpguard_outbox", now, now, 100, 200 * MIB)
        # huge:1 is due again (claimed until now), after small:1, never claimed yet.
        second = await rows.claim(conn, "smtpguard_outbox", now, now, 100, 200 * MIB)
        third = await rows.claim(conn, "smtpguard_outbox", now, now + 60, 100, 200 * MIB)
        fourth = await rows.claim(conn, "smtpguard_outbox", now, now + 60, 100, 200 * MIB)
    assert [(r.event_key, len(r.message) > 69 * MIB) for r in first.rows] == [("huge:1", True)]
    assert first.more
    assert [r.event_key for r in second.rows] == ["small:1"] and second.more
    # Both due again, huge:1 first (by id): alone again, small:1 in the claim after it.
    assert [r.event_key for r in third.rows] == ["huge:1"] and third.more
    assert [r.event_key for r in fourth.rows] == ["small:1"] and not fourth.more


def _rows_read(plan: dict[str, object]) -> int:
    """Rows the plan's scans of the table produced, each loop counted."""
    own = 0
    if "Scan" in str(plan.get("Node Type", "")) and plan.get("Relation Name") == "smtpguard_outbox":
        own = int(plan["Actual Rows"]) * int(plan["Actual Loops"])  # type: ignore[call-overload]
    return own + sum(_rows_read(p) for p in plan.get("Plans", []))  # type: ignore[attr-defined]


async def test_a_claim_on_a_backlog_reads_a_batch_not_the_whole_backlog(
    postgres_server: PostgresServer,
) -> None:
    import psycopg

    from smtpguard.outbox import rows

    # 80,000 rows never tried and 20,000 due for a retry (an outage's backlog): a claim of
    # 100 read and sorted every one of them (250,000 rows: 250 ms a claim, 2,500 claims to
    # drain them, the backlog's drain quadratic).
    url = app_database(postgres_server)
    with psycopg.connect(url, autocommit=True) as app:
        app.execute(
            "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, next_attempt_at) "
            "SELECT 'b:' || i, 'x', 'billing@acme.example', ARRAY['c@example.com'], "
            "CASE WHEN i % 5 = 0 THEN now() - interval '1 hour' END "
            "FROM generate_series(1, 100000) AS i"
        )
        app.execute("VACUUM ANALYZE smtpguard_outbox")
        now = time.time()
        params = {
            "now": rows.stamp(now),
            "until": rows.stamp(now + 30),
            "batch": 100,
            "max_size": 25_000_000,
            "octets": rows.CLAIM_OCTETS,
        }
        with app.transaction(force_rollback=True):
            explained = app.execute(
                rows._q("EXPLAIN (ANALYZE, FORMAT JSON) " + rows._CLAIM, "smtpguard_outbox"), params
            ).fetchone()
    assert explained is not None
    read = _rows_read(explained[0][0]["Plan"])
    print(f"a claim of 100 on a backlog of 100,000 rows read {read} of them")
    # The two batches a claim looks at (never tried, retried), and the 100 it updates.
    assert read <= 400, read
