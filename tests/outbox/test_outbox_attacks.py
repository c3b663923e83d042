"""The outbox attacked from the application's side: locks the application's own
transactions hold, and what the operator's console does meanwhile. Each counts what the
upstream got or what the page answered, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg

from tests.support import Upstream, running_guard
from tests.support.outbox import app_database, outbox_config
from tests.support.postgres import PostgresServer


async def test_the_console_queue_page_answers_while_a_migration_locks_the_outbox_table(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from tests.support.console import Operator, console_config, console_port

    url = app_database(postgres_server)
    cfg = console_config(tmp, upstream)
    cfg["outbox"] = outbox_config(tmp, upstream.port, url)["outbox"]
    async with running_guard(cfg) as server, await psycopg.AsyncConnection.connect(url) as migration:
        # A migration of the application (ALTER TABLE, say) holds the table's strongest lock.
        await migration.execute("LOCK TABLE smtpguard_outbox IN ACCESS EXCLUSIVE MODE")
        op = Operator(console_port(server))
        try:
            assert (await op.login("alice")).status == 200
            page = await asyncio.wait_for(op.get("/queue"), 20)
        finally:
            await op.close()
            await migration.rollback()
    assert page.status == 200
    assert "<td>shop</td>" in page.text and "unreadable:" in page.text
    assert "timeout" in page.text.lower() or "cancel" in page.text.lower(), page.text[-800:]

