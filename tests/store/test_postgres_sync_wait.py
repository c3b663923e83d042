"""A synchronous standby that is named but not connected (DESIGN.md §15, §18).

Every commit of the primary then waits for it. smtpguard's store calls have a deadline
(451 4.3.0, nothing sent); the schema migration at start has none, by design, and its
commit waited for ever: `serve` neither listened nor logged. Now `serve` listens after
MIGRATE_WAIT, answers 451 4.3.0 saying the migration is still running, and serves once the
commit returns (here: the operator clears synchronous_standby_names).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest

from smtpguard.store.postgres import MIGRATE_WAIT
from tests.support import Reply, Upstream, base_config, message, running_guard, send
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.slow


def sync_names(server: PostgresServer, names: str) -> None:
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = local")  # this session's own commits do not wait
        conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")
        conn.execute("SELECT pg_reload_conf()")


async def test_a_migration_waiting_for_an_absent_standby_does_not_hold_serve(
    postgres_server: PostgresServer, tmp: Path, upstream: Upstream
) -> None:
    name = "sg_sync_wait"
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    url = postgres_server.url.rsplit("/", 1)[0] + f"/{name}"
    cfg = base_config(tmp, upstream.port, store__url=url)
    cfg["zones"]["acme"].update(plan="unlimited", hourly_cap=1_000_000, monthly_cap=1_000_000)
    sync_names(postgres_server, "absent_standby")
    try:
        t0 = time.monotonic()
        async with running_guard(cfg) as guard:
            started = time.monotonic() - t0
            waiting = await send(guard.ports[0], message("sync:1"))
            sync_names(postgres_server, "")
            replies: list[Reply] = []
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and (not replies or replies[-1].code != 250):
                replies.append(await send(guard.ports[0], message("sync:1")))
                if replies[-1].code != 250:
                    await asyncio.sleep(0.2)
            await upstream.wait_received(1)
    finally:
        sync_names(postgres_server, "")
        with psycopg.connect(postgres_server.url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    print(f"serve listened after {started:.1f} s; {len(replies)} tries once the standby was cleared")
    assert started < MIGRATE_WAIT + 3, started
    assert waiting.code == 451 and waiting.text.startswith("4.3.0"), str(waiting)
    assert replies[-1].code == 250, [str(r) for r in replies]
    assert upstream.event_keys() == ["sync:1"]
