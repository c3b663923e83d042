"""The outbox when the application's database stops answering without going away: a
backend frozen (SIGSTOP: a stuck disk, a host paused, a path that drops every packet) keeps
the reader's connection open and silent. No statement of the reader waits on it for longer
than a claim lasts: the reader gives the connection up, makes a new one, and rows flow.
Counted at the recording upstream."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from tests.support import Upstream, eventually, running_guard
from tests.support.outbox import app_database, insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def test_a_frozen_connection_is_given_up_and_rows_flow_on_a_new_one(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url, poll="0.2s")
    cfg["event_key"].update({"lease": "2s"})
    async with running_guard(cfg) as server:
        reader = server.outbox[0]
        await insert(url, [row("before:1")])
        await eventually(
            lambda: receipts(url), lambda f: f["before:1"]["state"] == "sent", timeout=10, interval=0.05
        )
        assert reader._conn is not None
        frozen = reader._conn.info.backend_pid
        os.kill(frozen, signal.SIGSTOP)
        try:
            await insert(url, [row("after:1")])
            found = await eventually(
                lambda: receipts(url), lambda f: f["after:1"]["state"] == "sent", timeout=30, interval=0.1
            )
            assert reader.counters.outages >= 1
            assert reader._conn is not None and reader._conn.info.backend_pid != frozen
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
    assert found["after:1"]["state"] == "sent"
    assert upstream.event_keys() == ["before:1", "after:1"]
