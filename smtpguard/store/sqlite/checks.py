"""What a file must be before anything in it is changed (its journal mode included):
smtpguard's, and writable by this process. A failure is StoreUnfit naming the file and the
reason: `serve` exits 1 rather than fill another application's database with its tables,
or start on a store that answers every submission 451 4.3.0 while systemd and /readyz
call it ready."""

from __future__ import annotations

import functools
import os
import sqlite3
from pathlib import Path

from smtpguard.store.base import StoreUnfit
from smtpguard.store.sqlite.migrate import APPLICATION_ID, MIGRATIONS, schema_version, statements

_SQLITE_READONLY = 8
_SQLITE_CANTOPEN = 14
_SHOWN = 5


@functools.cache
def _shapes() -> dict[str, frozenset[str]]:
    """The columns of each table of migration 1, less the queue's smtputf8 (migrate._adopt
    adds it): what every earlier release's file had (each table of the schema of all 39
    versions before numbered migrations has them)."""
    conn = sqlite3.connect(":memory:")
    try:
        for statement in statements(MIGRATIONS[0]):
            conn.execute(statement)
        return {table: frozenset(columns - {"smtputf8"}) for table, columns in _columns(conn).items()}
    finally:
        conn.close()


def _columns(conn: sqlite3.Connection) -> dict[str, set[str]]:
    names = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite%' ORDER BY name"
    ).fetchall()
    # pragma_table_info(?): a table's name, whatever it holds, stays a parameter.
    column = "SELECT name FROM pragma_table_info(?)"
    return {str(name): {str(c) for (c,) in conn.execute(column, (name,))} for (name,) in names}


def check_ours(conn: sqlite3.Connection, path: Path) -> None:
    """A file with tables must be smtpguard's: marked with APPLICATION_ID, or, unmarked
    (written before the mark; user_version 0 before numbered migrations), holding tables of
    smtpguard's names, each with at least the columns every release gave it. A new or
    empty file is for smtpguard to fill. Reads only: a refused file is left as it was."""
    marked = int(conn.execute("PRAGMA application_id").fetchone()[0])
    if marked == APPLICATION_ID:
        return
    if marked != 0:
        raise StoreUnfit(
            f"{path} is not an smtpguard store: its application_id is {marked:#010x} (smtpguard's is "
            f"{APPLICATION_ID:#010x}); check store.url"
        )
    tables = _columns(conn)
    shapes = _shapes()
    ours = [table for table in tables if table in shapes]
    misshapen = [table for table in ours if not shapes[table] <= tables[table]]
    if not tables or (ours and not misshapen):
        return
    shown = ", ".join(list(tables)[:_SHOWN]) + (
        f" and {len(tables) - _SHOWN} more" if len(tables) > _SHOWN else ""
    )
    found = (
        f"{', '.join(misshapen)} without smtpguard's columns" if misshapen else "none of smtpguard's tables"
    )
    raise StoreUnfit(
        f"{path} is not an smtpguard store: it has {len(tables)} table(s) ({shown}), "
        f"user_version {schema_version(conn)}, no application_id, and {found}; check store.url"
    )


def cannot_write(path: Path) -> str | None:
    """Why this process may not write the store at `path` (the file, or its folder, where
    SQLite keeps the -wal and -shm), as the file system says; None when it may. Two
    access(2) calls (a statvfs more on a refusal): /readyz asks it at every request."""
    for target in (path, path.parent):
        if os.access(target, os.W_OK) or not os.path.lexists(target):
            continue
        if os.statvfs(target).f_flag & os.ST_RDONLY:
            return f"{target} is on a read-only file system"
        return f"{target} is not writable by uid {os.getuid()}"
    return None


def check_writable(conn: sqlite3.Connection, path: Path) -> None:
    """SQLite opens a file it may not write read-only without a word, and a BEGIN IMMEDIATE
    on it succeeds: only a write tells. One, of the version the file has already, inside a
    transaction rolled back: nothing reaches the file, no fsync."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(f"PRAGMA user_version = {schema_version(conn):d}")
    finally:
        conn.execute("ROLLBACK")


def unwritable(path: Path, error: sqlite3.Error) -> StoreUnfit | None:
    """The StoreUnfit for `error` met while opening `path` to write, when it says the file
    may not be written (None for any other error)."""
    code = getattr(error, "sqlite_errorcode", 0) & 0xFF
    why = cannot_write(path)
    if code == _SQLITE_READONLY or (code == _SQLITE_CANTOPEN and why is not None):
        return StoreUnfit(
            f"cannot write {path}: {why or f'SQLite: {error}'}; serve needs the file and its "
            "folder writable (systemd: the folder in StateDirectory= or ReadWritePaths=)"
        )
    return None
