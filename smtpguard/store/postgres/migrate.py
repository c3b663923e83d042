"""Schema upgrades, outside the hot path (DESIGN.md §18).

Each migration (migrations/NNNN_*.sql beside this module: add a file, never edit one that
has shipped) runs once, in order, on a connection of its own with no statement deadline:
an index build on a ledger of a million rows takes as long as it takes (inside the 2 s
deadline of a store call it was cancelled on every try, and the schema never moved). An
index a migration builds on a table that already holds many rows is built first with
CREATE INDEX CONCURRENTLY, outside the migration's transaction, so instances of the
previous release keep writing meanwhile; the rest of the migration and the version it
brings commit together. A session advisory lock keeps two instances from running one
migration twice (the previous release takes the same lock, per transaction).

A role that may only read and write the tables (SELECT, INSERT, UPDATE, DELETE) serves a
current schema: nothing is created when nothing is missing. Finding the schema behind and
not allowed to change it is SchemaBehind, naming the role.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql

log = logging.getLogger("smtpguard.store")

MIGRATIONS: list[str] = [
    f.read_text()
    for f in sorted(resources.files(__package__).joinpath("migrations").iterdir(), key=lambda f: f.name)
    if f.name.endswith(".sql")
]
LATEST = len(MIGRATIONS)
MIGRATION_LOCK = 0x736D7470  # 'smtp': the advisory lock key every release uses
LARGE_TABLE = 10_000
"""Rows above which an index is built concurrently: below, the build is milliseconds and
the transaction is simpler."""
LOCK_POLL = 0.2
"""Seconds between tries at the migration lock while another instance migrates."""
BUILD_TRIES = 5
"""Concurrent builds of one index aborted as a deadlock before the migration gives up."""

_INDEX = re.compile(r"^CREATE (UNIQUE )?INDEX (\w+) ON (\w+)\b[^;]*;[ \t]*\n?", re.MULTILINE)


class SchemaBehind(Exception):
    """The schema is older than this release and this role may not bring it up to date
    (or a migration failed: the message says which)."""


@dataclass(frozen=True)
class Migrated:
    before: int
    after: int
    concurrent: tuple[str, ...]
    seconds: float


async def schema_version(conn: AsyncConnection[Any]) -> int:
    row = await (await conn.execute("SELECT to_regclass('smtpguard_schema') IS NOT NULL")).fetchone()
    if not row or not row[0]:
        return 0
    row = await (await conn.execute("SELECT max(version) FROM smtpguard_schema")).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


async def migrate(conn: AsyncConnection[Any]) -> Migrated:
    """Bring the schema to LATEST on `conn` (autocommit). Waits for another instance that
    is migrating; returns at once when the schema is current (one query, no lock)."""
    started = time.monotonic()
    before = await schema_version(conn)
    if before >= LATEST:
        return Migrated(before, before, (), 0.0)
    role = await _role(conn)
    await conn.execute("SET statement_timeout = 0")
    await _lock(conn)
    concurrent: list[str] = []
    try:
        # Read again under the lock: another instance may have migrated while we waited.
        before = await schema_version(conn)
        for version, text in enumerate(MIGRATIONS[before:], start=before + 1):
            try:
                concurrent += await _migrate_one(conn, version, text)
            except psycopg.errors.InsufficientPrivilege as e:
                raise SchemaBehind(_behind(role, version - 1, e)) from e
    finally:
        await conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
        await conn.execute("RESET statement_timeout")
    took = time.monotonic() - started
    if before >= LATEST:
        return Migrated(before, before, (), took)
    log.info(
        "store schema migrated",
        extra={"from": before, "to": LATEST, "concurrently": concurrent, "seconds": round(took, 3)},
    )
    return Migrated(before, LATEST, tuple(concurrent), took)


async def _lock(conn: AsyncConnection[Any]) -> None:
    """The migration lock, waited for between statements. pg_advisory_lock waits inside its
    statement and so holds a snapshot; the instance holding the lock may be in CREATE INDEX
    CONCURRENTLY, which waits for every older snapshot: each waits for the other and
    PostgreSQL aborts one (the second `smtpguard migrate` failed with a deadlock). A try
    holds a snapshot for a moment only."""
    waiting = False
    while True:
        row = await (await conn.execute("SELECT pg_try_advisory_lock(%s)", (MIGRATION_LOCK,))).fetchone()
        if row and row[0]:
            return
        if not waiting:
            waiting = True
            log.info("store schema: waiting for another instance's migration")
        await asyncio.sleep(LOCK_POLL)


async def _migrate_one(conn: AsyncConnection[Any], version: int, text: str) -> list[str]:
    built: list[str] = []
    for m in list(_INDEX.finditer(text)):
        name, table = m.group(2), m.group(3)
        if not await _large(conn, table):
            continue
        await _build_concurrently(conn, name, m.group(0))
        built.append(name)
        text = text.replace(m.group(0), "")
    async with conn.transaction():
        if version == 1:
            await conn.execute("CREATE TABLE IF NOT EXISTS smtpguard_schema (version integer NOT NULL)")
        await conn.execute(text.encode())
        await conn.execute("INSERT INTO smtpguard_schema (version) VALUES (%s)", (version,))
    return built


async def _large(conn: AsyncConnection[Any], table: str) -> bool:
    row = await (await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,))).fetchone()
    if not row or not row[0]:
        return False  # created by this very migration: empty
    query = sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {} LIMIT %s) t").format(sql.Identifier(table))
    row = await (await conn.execute(query, (LARGE_TABLE + 1,))).fetchone()
    return bool(row and int(row[0]) > LARGE_TABLE)


async def _build_concurrently(conn: AsyncConnection[Any], name: str, statement: str) -> None:
    # A build cancelled earlier (a crash, a stop) leaves an invalid index behind: dropped
    # and built again; a valid one is kept (this migration was interrupted after it).
    row = await (
        await conn.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.oid = to_regclass(%s)",
            (name,),
        )
    ).fetchone()
    if row is not None and row[0]:
        return
    if row is not None:
        await conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(name)))
    concurrent = re.sub(r"^CREATE (UNIQUE )?INDEX ", r"CREATE \1INDEX CONCURRENTLY ", statement.strip())
    for attempt in range(1, BUILD_TRIES + 1):
        try:
            await conn.execute(concurrent.rstrip(";").encode())
            return
        except psycopg.errors.DeadlockDetected:
            # A previous release waits for the migration lock inside its statement
            # (pg_advisory_xact_lock) while this build waits for its snapshot; when the
            # build is the side aborted, it leaves an invalid index: dropped, built again
            # (the previous release's wait ends with its call's deadline).
            if attempt == BUILD_TRIES:
                raise
            log.warning("store schema: index build %s aborted as a deadlock; building it again", name)
            await conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(name)))


async def _role(conn: AsyncConnection[Any]) -> str:
    row = await (await conn.execute("SELECT current_user")).fetchone()
    return str(row[0]) if row else "?"


def _behind(role: str, version: int, e: psycopg.Error) -> str:
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"postgresql schema is at version {version}, this release needs {LATEST}, and role "
        f"{role!r} may not change it ({why}): run `smtpguard migrate -c FILE` as the schema's "
        "owner (docs/stores.md)"
    )


async def migrate_on_own_connection(conninfo: str, kwargs: dict[str, Any]) -> Migrated | None:
    """Connect, migrate, disconnect. None: no server answered (try again later)."""
    try:
        conn = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
    except (psycopg.OperationalError, OSError):
        return None
    try:
        async with conn:
            return await migrate(conn)
    except (psycopg.OperationalError, OSError) as e:
        if conn.broken or isinstance(e, OSError):
            return None  # the server went away: try again later
        # The server answered with an error of its own (a deadlock, a disk full): saying
        # "no server answered" would send the operator to the wrong place.
        raise SchemaBehind(f"postgresql: migrating the schema failed: {type(e).__name__}: {e}".strip()) from e
    except psycopg.Error as e:
        raise SchemaBehind(f"postgresql: migrating the schema failed: {type(e).__name__}: {e}".strip()) from e
