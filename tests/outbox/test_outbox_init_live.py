"""`outbox init` run again on a live table (it is idempotent, so operators re-run it at a
deploy): its trigger is dropped and made anew, which needs the table to itself. Waiting for
that behind an application's open transaction, it queued every other transaction's insert
behind it: the application's checkouts stalled for as long as one transaction stayed open.
It must give up instead, name why, and leave the application's inserts flowing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest

from smtpguard.cli import main
from tests.support import Upstream, eventually, running_guard, write_config
from tests.support.outbox import app_database, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def test_init_on_a_table_an_open_transaction_writes_to_gives_up_and_inserts_flow(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url)
    path = write_config(tmp / "smtpguard.yaml", cfg)
    async with running_guard(cfg):
        slow = await psycopg.AsyncConnection.connect(url)
        try:
            # A business transaction that inserted its row and is still at work.
            await insert_in(slow, row("slow:1"))
            init = asyncio.create_task(asyncio.to_thread(main, ["outbox", "init", "-c", str(path), "shop"]))
            await eventually(lambda: _waiting_on_a_lock(url), timeout=10, interval=0.05)
            # Other business transactions insert meanwhile, each bounded as a web request is.
            started = time.monotonic()
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as app:
                await app.execute("SET statement_timeout = '10s'")
                for i in range(3):
                    await app.execute(
                        "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to) "
                        "VALUES (%s, %s, %s, %s)",
                        (
                            f"fast:{i}",
                            row(f"fast:{i}").message,
                            "billing@acme.example",
                            ["customer@example.com"],
                        ),
                    )
            waited = time.monotonic() - started
            code = await asyncio.wait_for(init, 10)
        finally:
            await slow.commit()
            await slow.close()
        found = await eventually(
            lambda: receipts(url),
            lambda f: len(f) == 4 and all(r["state"] == "sent" for r in f.values()),
            timeout=10,
            interval=0.05,
        )
    err = capsys.readouterr().err
    print(f"inserts behind init waited {waited:.1f} s; init exited {code}: {err.strip()}")
    assert code == 4 and "lock" in err, err
    assert sorted(found) == ["fast:0", "fast:1", "fast:2", "slow:1"]
    assert sorted(upstream.event_keys()) == ["fast:0", "fast:1", "fast:2", "slow:1"]
    # With the table free, init runs again as before.
    assert await asyncio.to_thread(main, ["outbox", "init", "-c", str(path), "shop"]) == 0


async def insert_in(conn: psycopg.AsyncConnection[tuple[object, ...]], r: object) -> None:
    from tests.support.outbox import OutRow

    assert isinstance(r, OutRow)
    await conn.execute(
        "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to) VALUES (%s, %s, %s, %s)",
        (r.event_key, r.message, r.mail_from, list(r.rcpt_to)),
    )


async def _waiting_on_a_lock(url: str) -> bool:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%TRIGGER%'"
        )
        found = await cur.fetchone()
    return bool(found and found[0])
