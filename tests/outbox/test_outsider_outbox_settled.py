"""A held row settled as delivered (an operator's `resolve --as delivered`, an accepted
verdict): its receipt reads `sent`, and its reply must say so. The provider's reply never
came, so the record holds none: the row kept the `451 4.3.0 … held` it had, a `sent` row
whose reply an application reading the code takes for a refusal. Counted at the upstream."""

from __future__ import annotations

from pathlib import Path

from smtpguard import desk
from tests.support import Behaviour, FakeClock, Upstream, eventually, running_guard
from tests.support.outbox import app_database, insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def test_a_held_row_resolved_as_delivered_reads_a_250_naming_its_sg_id(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    clock = FakeClock()
    # The message reaches the provider and its reply never comes: the outcome is unknown.
    upstream.handler.script = [Behaviour(drop_after_dot=True)]
    async with running_guard(outbox_config(tmp, upstream.port, url), clock=clock) as server:
        await insert(url, [row("held:1")])
        held = await eventually(
            lambda: receipts(url), lambda f: f["held:1"]["state"] == "held", timeout=15, interval=0.05
        )
        assert str(held["held:1"]["reply"]).startswith("451 4.3.0")
        assert server.store is not None
        await desk.decide(server.store, "acme", "held:1", "delivered", "cli:night-desk", None)
        clock.t += 61
        server.outbox[0].wake()
        found = await eventually(
            lambda: receipts(url), lambda f: f["held:1"]["state"] == "sent", timeout=10, interval=0.05
        )
    r = found["held:1"]
    sg_id = held["held:1"]["sg_id"]
    assert r["sg_id"] == sg_id and r["done_at"] is not None
    assert str(r["reply"]).startswith(f"250 2.0.0 [sg:{sg_id}]"), r["reply"]
    assert "cli:night-desk" in str(r["reply"]), r["reply"]
    assert upstream.event_keys() == ["held:1"]
