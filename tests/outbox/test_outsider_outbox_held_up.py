"""Attacks on the outbox that it withstood, kept so that it goes on withstanding them: one
event key in the tables of two sources of one zone, and the LISTEN connection cut by the
database while the reader's other connection stays. Counted at the recording upstream."""

from __future__ import annotations

from pathlib import Path

import psycopg

from tests.support import Upstream, eventually, running_guard
from tests.support.outbox import app_database, insert, open_states, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def test_one_key_in_two_sources_of_one_zone_is_sent_once(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    shop, blog = app_database(postgres_server), app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, shop)
    cfg["outbox"]["blog"] = {**cfg["outbox"]["shop"], "url": blog}
    async with running_guard(cfg):
        await insert(shop, [row("same:1"), row("reused:1")])
        await eventually(
            lambda: receipts(shop), lambda f: len(f) == 2 and not open_states(f), timeout=10, interval=0.05
        )
        await insert(blog, [row("same:1"), row("reused:1", subject="another message")])
        second = await eventually(
            lambda: receipts(blog), lambda f: len(f) == 2 and not open_states(f), timeout=10, interval=0.05
        )
    first = await receipts(shop)
    assert first["same:1"]["state"] == first["reused:1"]["state"] == "sent"
    # The ledger is the zone's: the second table's row of the same event reads duplicate.
    assert second["same:1"]["state"] == "duplicate"
    assert f"[sg:{first['same:1']['sg_id']}]" in str(second["same:1"]["reply"])
    assert second["reused:1"]["state"] == "failed"
    assert str(second["reused:1"]["reply"]).startswith("550 5.7.0"), second["reused:1"]
    assert upstream.event_keys() == ["same:1", "reused:1"]


async def test_the_listen_connection_cut_by_the_database_is_made_anew_and_wakes_the_reader(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    # Polling an hour apart: only a notification can wake the reader within the test.
    async with running_guard(outbox_config(tmp, upstream.port, url, poll="1h")) as server:
        reader = server.outbox[0]
        await eventually(lambda: reader.counters.passes, lambda n: n >= 1, timeout=10, interval=0.05)
        with psycopg.connect(url, autocommit=True) as admin:
            cut = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'"
            ).fetchall()
        assert cut == [(True,)]
        await eventually(lambda: reader.counters.reconnects, lambda n: n >= 2, timeout=10, interval=0.05)
        await insert(url, [row("after-cut:1")])
        found = await eventually(
            lambda: receipts(url), lambda f: f["after-cut:1"]["state"] == "sent", timeout=10, interval=0.05
        )
        assert reader.counters.polls == 0 and reader.counters.notified >= 1
    assert found["after-cut:1"]["state"] == "sent"
    assert upstream.event_keys() == ["after-cut:1"]
