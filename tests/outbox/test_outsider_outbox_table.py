"""The outbox table as an application's migration made it, not `outbox init`: the DDL of
`outbox schema` applied in the migration's own transaction by another role, then changed
as applications change their tables. What smtpguard exports about it stays bounded."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import psycopg

from smtpguard.outbox.schema import ddl
from tests.support import Upstream, eventually, free_port, running_guard
from tests.support.outbox import insert, new_database, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def test_states_the_application_writes_into_its_own_table_add_no_metric_series(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = new_database(postgres_server)
    with psycopg.connect(url) as migration:
        # A migration tool: the printed DDL in its transaction, then the application's own
        # change (its CHECK dropped to keep an `archived:<batch>` state of its own).
        migration.execute(ddl())  # type: ignore[arg-type]
        migration.execute("ALTER TABLE smtpguard_outbox DROP CONSTRAINT smtpguard_outbox_state_check")
        migration.execute(
            "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, state) "
            "SELECT 'old:' || i, 'x', 'billing@acme.example', ARRAY['c@example.com'], 'archived:' || i "
            "FROM generate_series(1, 300) AS i"
        )
    metrics_port = free_port()
    cfg = outbox_config(tmp, upstream.port, url)
    cfg["metrics"] = {"address": f"127.0.0.1:{metrics_port}"}
    async with running_guard(cfg), aiohttp.ClientSession() as http:
        await insert(url, [row("new:1")])
        await eventually(
            lambda: receipts(url), lambda f: f["new:1"]["state"] == "sent", timeout=10, interval=0.05
        )

        async def scrape() -> str:
            async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                return await r.text()

        # The counts are refreshed at most once a second: wait for the one that saw new:1.
        text = await eventually(
            scrape,
            lambda t: 'smtpguard_outbox_rows{source="shop",state="sent"} 1.0' in t,
            timeout=10,
            interval=0.1,
        )
    series = re.findall(r'^smtpguard_outbox_rows\{source="shop",state="([^"]*)"\}', text, re.M)
    # One series per state smtpguard writes, whatever the application keeps in its table.
    assert sorted(series) == ["duplicate", "expired", "failed", "held", "pending", "sent"], len(series)
    assert upstream.event_keys() == ["new:1"]
