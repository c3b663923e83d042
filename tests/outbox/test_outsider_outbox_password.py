"""The outbox role's password, from `password_env`, against a server that asks for it
(scram-sha-256): a right one serves, a wrong one is an outage the log names without the
secret, either way, and the secret is never in the process's command line."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path

import psycopg
import pytest

from smtpguard.outbox.schema import ddl
from tests.support import Upstream, eventually, running_guard
from tests.support.outbox import insert, new_database, outbox_config, receipts, row
from tests.support.postgres import PostgresServer

SECRET = f"pw-{uuid.uuid4().hex}"


async def test_the_password_is_used_and_never_logged_nor_on_the_command_line(
    tmp: Path,
    upstream: Upstream,
    postgres_server: PostgresServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = new_database(postgres_server)
    role = f"sg_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(ddl())  # type: ignore[arg-type]
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{SECRET}'")  # type: ignore[arg-type]
        admin.execute(f"GRANT SELECT, UPDATE ON smtpguard_outbox TO {role}")  # type: ignore[arg-type]
    hba = postgres_server.data / "pg_hba.conf"
    before = hba.read_text()
    # First match wins: this role alone must give its password over TCP.
    hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n" + before)
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_reload_conf()")
    try:
        least = url.replace("://postgres@", f"://{role}@")
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(least, connect_timeout=5).close()  # the server asks for it
        caplog.set_level(logging.DEBUG)
        monkeypatch.setenv("SHOP_OUTBOX_PASSWORD", "not-" + SECRET)
        cfg = outbox_config(tmp, upstream.port, least, password_env="SHOP_OUTBOX_PASSWORD")
        async with running_guard(cfg) as server:
            await insert(url, [row("pw:1")])
            await eventually(
                lambda: server.outbox[0].counters.outages, lambda n: n >= 2, timeout=10, interval=0.05
            )
        monkeypatch.setenv("SHOP_OUTBOX_PASSWORD", SECRET)
        async with running_guard(cfg):
            found = await eventually(
                lambda: receipts(url), lambda f: f["pw:1"]["state"] == "sent", timeout=10, interval=0.05
            )
            cmdline = await asyncio.to_thread(Path(f"/proc/{os.getpid()}/cmdline").read_bytes)
    finally:
        hba.write_text(before)
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("SELECT pg_reload_conf()")
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "password authentication failed" in logged  # the outage is named…
    assert SECRET not in logged  # …without the secret, the wrong one or the right one
    assert SECRET.encode() not in cmdline
    assert found["pw:1"]["state"] == "sent"
    assert upstream.event_keys() == ["pw:1"]
