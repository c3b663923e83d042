"""The last landed release and this one serving one PostgreSQL ledger (DESIGN.md §18).

A rolling upgrade from 44f68cc (schema 4; this release adds the reconciliation cursors,
schema 5, a table the old release never touches): the old release makes the store with its
own migrations and serves; this release starts on it, migrates it while the old one keeps
serving, and serves beside it. The same events are submitted to both at
once and again to each: counted at the upstream, each is sent once, and each instance
answers the other's as a duplicate.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import psycopg
import pytest

from smtpguard.store.postgres.migrate import LATEST
from tests.support import GuardProcess, Upstream, base_config, free_port, message, send, write_config
from tests.support.postgres import PostgresServer
from tests.support.releases import extract_release

pytestmark = pytest.mark.slow

LAST_RELEASE = "44f68cc"
LAST_SCHEMA = 4
KEYS = 12


def config(tmp: Path, upstream: Upstream, url: str, instance: str, port: int) -> Path:
    cfg = base_config(tmp, upstream.port, instance=instance, store__url=url)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    cfg["zones"]["acme"].update(plan="unlimited", hourly_cap=1_000_000, monthly_cap=1_000_000)
    return write_config(tmp / f"{instance}.yaml", cfg)


async def test_the_last_release_and_this_one_serve_one_ledger(
    postgres_server: PostgresServer, tmp: Path, upstream: Upstream
) -> None:
    name = "sg_rolling"
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    url = postgres_server.url.rsplit("/", 1)[0] + f"/{name}"
    with tempfile.TemporaryDirectory(prefix="smtpguard-release-") as src:
        await asyncio.to_thread(extract_release, LAST_RELEASE, Path(src))
        old_port, new_port = free_port(), free_port()
        old = GuardProcess(config(tmp, upstream, url, "old", old_port), tmp / "old.log", src=Path(src))
        new = GuardProcess(config(tmp, upstream, url, "new", new_port), tmp / "new.log")
        try:
            old.start()
            await old.wait_port(old_port, timeout=30)
            with psycopg.connect(url, autocommit=True) as conn:
                row = conn.execute("SELECT max(version) FROM smtpguard_schema").fetchone()
            assert row == (LAST_SCHEMA,), "the last release made its own schema"
            new.start()
            await new.wait_port(new_port, timeout=30)
            with psycopg.connect(url, autocommit=True) as conn:
                row = conn.execute("SELECT max(version) FROM smtpguard_schema").fetchone()
            assert row == (LATEST,), "this release migrated it"
            together = [
                await asyncio.gather(*(send(port, message(f"roll:{i}")) for port in (old_port, new_port)))
                for i in range(KEYS)
            ]
            await upstream.wait_received(KEYS)
            again = [
                await send(port, message(f"roll:{i}")) for i in range(KEYS) for port in (new_port, old_port)
            ]
        finally:
            await asyncio.to_thread(new.stop)
            await asyncio.to_thread(old.stop)
            with psycopg.connect(postgres_server.url, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    keys = upstream.event_keys()
    assert sorted(keys) == sorted(f"roll:{i}" for i in range(KEYS)), sorted(keys)
    # At once: one of the two sent it; the other waited and answered the duplicate, or 451.
    assert all(250 in (a.code, b.code) for a, b in together), [(str(a), str(b)) for a, b in together]
    assert [r.code for r in again] == [250] * (2 * KEYS) and all("duplicate" in r.text for r in again)
