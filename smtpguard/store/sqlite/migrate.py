"""Schema upgrades of a SQLite file, numbered and counted in PRAGMA user_version
(DESIGN.md §18), as store/postgres/migrations/ does it for PostgreSQL.

Each migration (migrations/NNNN_*.sql beside this module: add a file, never edit one that
has shipped) runs once, in order. All that a file is missing runs in one BEGIN IMMEDIATE
transaction together with the version it brings: two processes opening one file (workers,
the CLI) never both run a migration, and a crash leaves the file at the version before.

A file of user_version 0 was written before numbered migrations, by any earlier release
(or is new): it may lack any table, the queue's SMTPUTF8 column or the state counts. It is
brought to version 2 the way those releases did it at every open: migration 1 runs again
over it (CREATE … IF NOT EXISTS adds what it lacks), the column is added where it is
missing (SQL cannot add a column only if absent), and migration 2 runs unless the counts
are already there. Every migration after 2 is plain SQL, run once.
"""

from __future__ import annotations

import sqlite3
from importlib import resources

MIGRATIONS: list[str] = [
    f.read_text()
    for f in sorted(resources.files(__package__).joinpath("migrations").iterdir(), key=lambda f: f.name)
    if f.name.endswith(".sql")
]
LATEST = len(MIGRATIONS)
APPLICATION_ID = 0x53475244
"""PRAGMA application_id of smtpguard's files ("SGRD"), set by migrate(): a file another
application marked is refused (checks.py), an unmarked one of an earlier release is marked."""
_ADOPTED = 2
"""The version a file from before numbered migrations is brought to by _adopt."""


def statements(text: str) -> list[str]:
    """The statements of a migration, one each (a trigger's body keeps its semicolons)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    found: list[str] = []
    pending = ""
    for piece in "\n".join(lines).split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                found.append(pending.strip())
            pending = ""
    return found


def schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection) -> tuple[int, int]:
    """Bring the file to LATEST on `conn` (autocommit mode) and mark it smtpguard's
    (APPLICATION_ID, once). Returns (before, after); a file of a newer release (a version
    above LATEST) is left at its version."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        before = schema_version(conn)
        if before < LATEST:
            done = _adopt(conn) if before == 0 else before
            for text in MIGRATIONS[done:]:
                _run(conn, text)
            # PRAGMA takes no parameter; LATEST is the count of files, an int.
            conn.execute(f"PRAGMA user_version = {LATEST:d}")
        if int(conn.execute("PRAGMA application_id").fetchone()[0]) != APPLICATION_ID:
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID:d}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return before, max(before, LATEST)


def _adopt(conn: sqlite3.Connection) -> int:
    _run(conn, MIGRATIONS[0])
    columns = {row[1] for row in conn.execute("PRAGMA table_info(queue)")}
    if "smtputf8" not in columns:  # a file from before queued mail kept the flag
        conn.execute("ALTER TABLE queue ADD COLUMN smtputf8 INTEGER NOT NULL DEFAULT 0")
    counted = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'state_counts'"
    ).fetchone()
    if counted is None:
        _run(conn, MIGRATIONS[1])
    return _ADOPTED


def _run(conn: sqlite3.Connection, text: str) -> None:
    for statement in statements(text):
        conn.execute(statement)
