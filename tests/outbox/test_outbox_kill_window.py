"""`kill -9` of serve in the exact window between the provider's 250 and the row's receipt:
the ledger holds the send, the row does not. The window is made to last by the
application's own lock on the row (the receipt waits for it), not by a guessed sleep. The
next serve submits the row again: it reads `duplicate`, naming the first send, and the
upstream got one copy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg

from smtpguard.store import store_from_url
from tests.support import Behaviour, GuardProcess, Upstream, eventually, free_port, write_config
from tests.support.outbox import app_database, insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def test_kill_9_after_the_upstream_250_before_the_receipt_reads_duplicate_one_copy(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url)
    port = free_port()
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    # A short lease: the dead instance's claim comes back within the test.
    cfg["event_key"].update({"lease": "2s"})
    path = write_config(tmp / "smtpguard.yaml", cfg)
    dot = asyncio.Event()
    upstream.handler.script = [Behaviour(hold_after_dot=dot)]
    await insert(url, [row("window:1")])
    first = GuardProcess(path, tmp / "first.log")
    first.start()
    app = await psycopg.AsyncConnection.connect(url)
    store = store_from_url(cfg["store"]["url"])
    await store.open()
    try:
        await first.wait_port(port)
        await upstream.wait_received(1, timeout=20)
        # The message is at the provider, its 250 not given yet: the application locks the
        # row (the claim's transaction is long over), then the provider answers.
        await app.execute("SELECT id FROM smtpguard_outbox WHERE event_key = 'window:1' FOR UPDATE")
        dot.set()
        record = await eventually(
            lambda: store.get("acme", "window:1"),
            lambda r: r is not None and r.state.value == "delivered",
            timeout=10,
            interval=0.05,
        )
        assert (await receipts(url))["window:1"]["state"] == "pending"  # the receipt waits
    finally:
        first.kill()
        await app.rollback()
        await app.close()
        await store.close()
    assert record is not None
    second = GuardProcess(path, tmp / "second.log")
    second.start()
    try:
        await second.wait_port(port)
        found = await eventually(
            lambda: receipts(url), lambda f: f["window:1"]["state"] != "pending", timeout=20, interval=0.1
        )
    finally:
        await second.astop()
    r = found["window:1"]
    assert r["state"] == "duplicate", r
    assert f"[sg:{record.sg_id}]" in str(r["reply"]) and r["sg_id"] == record.sg_id, r
    assert upstream.event_keys() == ["window:1"]
