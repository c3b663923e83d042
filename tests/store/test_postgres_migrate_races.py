"""Schema migrations that meet each other (DESIGN.md §18), on a real PostgreSQL.

A large ledger's indexes are built with CREATE INDEX CONCURRENTLY, which waits for every
transaction whose snapshot is older than its own. A session that waits for the migration
lock *inside a statement* holds such a snapshot while it waits for the session that is
building: the two wait for each other and PostgreSQL aborts one of them.

- Two `smtpguard migrate` at once (a rolling upgrade whose first new instance starts while
  the operator's migrate runs does the same): both exit 0, the schema is current, every
  index valid.
- A previous release's instance starting meanwhile (44f68cc's open takes the same lock
  with pg_advisory_xact_lock inside its migration's transaction) does not make the build
  fail: the aborted build is built again.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from smtpguard.store.postgres.migrate import LATEST, MIGRATION_LOCK, MIGRATIONS
from tests.support import base_config, write_config
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RECORDS = 100_000
LEDGER_INDEXES = ["events_sid", "events_zone_state", "events_zone_updated"]


@pytest.fixture
def schema_one(postgres_server: PostgresServer) -> Iterator[str]:
    """A database at schema 1 whose ledger is large enough for concurrent index builds."""
    name = "sg_migrate_race"
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    url = postgres_server.url.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE smtpguard_schema (version integer NOT NULL)")
        conn.execute(MIGRATIONS[0].encode())
        conn.execute("INSERT INTO smtpguard_schema (version) VALUES (1)")
        conn.execute(
            "INSERT INTO events (zone, key, version, state, updated_at, data) "
            "SELECT 'acme', 'bulk:' || g, 1, 'delivered', g, "
            '\'{"zone":"acme","key":"bulk:\' || g || \'","sg_id":"sg\' || g || \'"}\' '
            "FROM generate_series(1, %s) g",
            (RECORDS,),
        )
        conn.execute("ANALYZE events")
    yield url
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def migrate(path: Path) -> tuple[int, str, str]:
    """`smtpguard migrate` as its own process (two at once, as two operators or instances)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smtpguard", "migrate", "-c", str(path), "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    return int(proc.returncode or 0), out.decode(), err.decode()


def indexes(url: str) -> list[tuple[str, bool]]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = ANY(%s) ORDER BY c.relname",
            (LEDGER_INDEXES,),
        ).fetchall()
        version = conn.execute("SELECT max(version) FROM smtpguard_schema").fetchone()
    assert version == (LATEST,), version
    return [(str(name), bool(valid)) for name, valid in rows]


async def building(url: str, timeout: float = 20) -> None:
    """Until a concurrent index build runs (seen in pg_stat_progress_create_index)."""
    deadline = time.monotonic() + timeout
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = await (await conn.execute("SELECT count(*) FROM pg_stat_progress_create_index")).fetchone()
            if row and row[0]:
                return
            await asyncio.sleep(0.02)
    raise AssertionError("no index build started")


async def test_two_migrations_at_once_both_succeed(schema_one: str, tmp: Path) -> None:
    path = write_config(tmp / "m.yaml", base_config(tmp, None, store__url=schema_one))
    first = asyncio.create_task(migrate(path))
    await building(schema_one)
    t0 = time.monotonic()
    second = await migrate(path)
    waited = time.monotonic() - t0
    done = await first
    print(f"second migrate waited {waited:.2f} s for the first: {second[1].strip()}")
    assert done[0] == 0, done
    assert second[0] == 0, second
    one, two = json.loads(done[1]), json.loads(second[1])
    assert (one["from"], one["to"]) == (1, LATEST)
    assert sorted(one["concurrently"]) == LEDGER_INDEXES
    assert (two["from"], two["to"], two["migrated"]) == (LATEST, LATEST, False), two
    assert indexes(schema_one) == [(name, True) for name in LEDGER_INDEXES]


async def test_a_previous_release_starting_meanwhile_does_not_fail_the_build(
    schema_one: str, tmp: Path
) -> None:
    """The previous release's open: BEGIN; SELECT pg_advisory_xact_lock(key) with its
    per-call deadline (here statement_timeout). Its own deadlock check is put off past that
    deadline, so that the cycle is found by the index build's check, which is the side
    PostgreSQL aborts: the case where the migration, not the old instance, pays.

    The build starts waiting for the old call's snapshot only after the call began, and checks
    for the cycle once, deadlock_timeout (1 s) later; it is then built again while the old
    call still waits, up to BUILD_TRIES times, until that call's deadline ends the wait. The
    release's 2 s deadline left the check 1 s to come first, which a loaded machine's build
    missed (a fresh clone's run beside other work): 3.5 s leaves it 2.5 s, and five tries of
    at least 1 s each still outlast it."""
    path = write_config(tmp / "m.yaml", base_config(tmp, None, store__url=schema_one))
    task = asyncio.create_task(migrate(path))
    await building(schema_one)
    outcome = ""
    async with await psycopg.AsyncConnection.connect(schema_one) as old:
        await old.execute("SET deadlock_timeout = '10s'")
        await old.execute("SET statement_timeout = '3.5s'")
        try:
            await old.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            outcome = "locked"
        except psycopg.errors.QueryCanceled:
            outcome = "deadline"  # as the previous release: 451 for now, tried again later
        await old.rollback()
    code, out, err = await task
    assert outcome in ("locked", "deadline")
    assert code == 0, (out, err)
    assert sorted(json.loads(out)["concurrently"]) == LEDGER_INDEXES
    # The build was the side aborted, and was built again.
    assert "aborted as a deadlock; building it again" in err, err
    assert indexes(schema_one) == [(name, True) for name in LEDGER_INDEXES]
