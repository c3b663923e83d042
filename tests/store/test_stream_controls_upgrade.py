"""A store written by the release before stream controls (DESIGN.md §16) opens under this one:
the SQLite file gains its paused-class and user-cap tables (and a read-only opener, the CLI,
reads them as empty), a PostgreSQL database at schema version 2 (the last release) is migrated
to the newest schema (4 brings the controls), and
records written without a `username` load as records of no user (no user cap counted)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import psycopg

from smtpguard.policy.limits import Caps, cap_check
from smtpguard.store import CapUsage, Reserved, Store, store_from_url
from smtpguard.store.postgres import _MIGRATIONS
from smtpguard.store.postgres.migrate import LATEST as PG_LATEST
from tests.store.test_store_contract import MONTH, NOW, fresh, user_cap
from tests.support.postgres import PostgresServer

NEW_TABLES = ("paused_classes", "user_sends", "user_monthly")


async def _stream_controls_work(s: Store) -> None:
    old = await s.get("acme", "old")
    assert old is not None and old.username is None
    assert await s.paused_classes() == set()
    await s.set_class_paused("acme", "bulk", True)
    assert await s.paused_classes() == {("acme", "bulk")}
    assert await s.reserve(fresh("k1"), None, user_cap("t1", "svc", hourly=1), False) == Reserved()
    assert await s.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(1, 1)}
    await s.refund("acme", "t1", MONTH)
    assert await s.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(0, 0)}
    assert await s.cap_usage("acme", NOW, MONTH) == CapUsage(0, 0)
    # A record of no user: the zone's unit alone.
    assert await s.reserve(fresh("k2"), None, cap_check("acme", Caps(5, 5), "t2", NOW), False) == Reserved()
    assert await s.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(0, 0)}


async def test_a_sqlite_file_of_the_previous_release_opens_with_stream_controls(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    s = store_from_url(url)
    await s.open()
    assert await s.reserve(fresh("old"), None, None, False) == Reserved()
    await s.close()
    conn = sqlite3.connect(tmp_path / "state.db")
    for table in NEW_TABLES:
        conn.execute(f"DROP TABLE {table}")
    conn.execute("PRAGMA user_version = 0")  # that release kept no schema version
    (data,) = conn.execute("SELECT data FROM events WHERE key = 'old'").fetchone()
    record = json.loads(data)
    del record["username"]  # as the previous release wrote it
    conn.execute("UPDATE events SET data = ? WHERE key = 'old'", (json.dumps(record),))
    conn.commit()
    conn.close()

    # The CLI opens it read-only (it cannot create the tables): empty, not "no such table".
    ro = store_from_url(url, read_only=True, create=False)
    await ro.open()
    try:
        assert await ro.paused_classes() == set()
        assert await ro.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(0, 0)}
    finally:
        await ro.close()
    s = store_from_url(url)
    await s.open()
    try:
        await _stream_controls_work(s)
    finally:
        await s.close()


async def test_a_postgresql_database_of_the_last_release_is_migrated_to_4(
    postgres_server: PostgresServer,
) -> None:
    admin = postgres_server.url
    url = admin.rsplit("/", 1)[0] + "/sg_upgrade3"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS sg_upgrade3")
        conn.execute("CREATE DATABASE sg_upgrade3")
    # The schema as the last release left it (migrations 1..2; 3 and 4 are this one's).
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE smtpguard_schema (version integer NOT NULL)")
        for version, sql in enumerate(_MIGRATIONS[:2], start=1):
            conn.execute(sql.encode())
            conn.execute("INSERT INTO smtpguard_schema (version) VALUES (%s)", (version,))
    s = store_from_url(url)
    await s.open()
    try:
        assert await s.reserve(fresh("old"), None, None, False) == Reserved()
        with psycopg.connect(url, autocommit=True) as conn:
            # 4 brings the stream controls; later migrations come with it.
            assert conn.execute("SELECT max(version) FROM smtpguard_schema").fetchone() == (PG_LATEST,)
            conn.execute("UPDATE events SET data = (data::jsonb - 'username')::text WHERE key = 'old'")
        await _stream_controls_work(s)
    finally:
        await s.close()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS sg_upgrade3 WITH (FORCE)")
