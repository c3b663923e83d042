"""A row the application changes while smtpguard is sending it (DESIGN.md §20): the receipt
is the answer to the row as it was read. Before, it was written by row id alone, so a pending
row the application rewrote to another event (its key and message) mid-send took the first
event's `sent`, and the second event was never sent: lost. Counted at the upstream, against
a real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import psycopg

from tests.support import Behaviour, Upstream, running_guard
from tests.support.eventually import eventually
from tests.support.outbox import app_database, insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def test_a_row_rewritten_to_another_event_mid_send_is_sent_as_that_event(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    # The provider takes the first message, then is slow to answer its final dot: the
    # application rewrites the row meanwhile.
    upstream.handler.script = [Behaviour(hang_after_dot=1.5)]
    second = row("order:2", subject="Order 2 shipped")
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        await insert(url, [row("order:1", subject="Order 1 shipped")])
        await upstream.wait_received(1)
        async with await psycopg.AsyncConnection.connect(url) as app:
            await app.execute(
                "UPDATE smtpguard_outbox SET event_key = %s, message = %s WHERE event_key = 'order:1'",
                (second.event_key, second.message),
            )
            await app.commit()
        found = await eventually(
            lambda: receipts(url),
            lambda f: f.get("order:2", {}).get("state") not in (None, "pending", "held"),
            timeout=15,
            interval=0.1,
        )
    assert found["order:2"]["state"] == "sent", found
    assert upstream.event_keys() == ["order:1", "order:2"]
    assert "Order 2 shipped" in upstream.received[1].content.decode()
