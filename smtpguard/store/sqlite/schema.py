"""Opening a SQLite file: its connections, and what a reader does with a file of an older
schema."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

from smtpguard.store.sqlite.checks import check_ours
from smtpguard.store.sqlite.migrate import MIGRATIONS, statements

_MIN_SQLITE = (3, 35, 0)
"""RETURNING (the optimistic cap counts) needs SQLite 3.35."""


def path_from_url(url: str) -> Path:
    """`sqlite:///var/x.db` is relative to the working directory, `sqlite:////x.db` absolute."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url}")
    return Path(url[len("sqlite:///") :])


_CREATE = re.compile(r"CREATE (TABLE|INDEX) IF NOT EXISTS (\w+)(?: ON (\w+))?")
_STATEMENTS = [statement for text in MIGRATIONS for statement in statements(text)]


def _stand_in_for_missing_tables(conn: sqlite3.Connection) -> None:
    """A store written by an older version lacks the newer tables until `serve` opens it for
    writing (store/sqlite/migrate.py). A read-only opener (the CLI) cannot create them there, so
    it creates empty TEMP tables of the same names on its own connection: each read of one
    finds nothing, rather than failing with "no such table"."""
    present = {str(name) for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    temp: set[str] = set()
    for sql in _STATEMENTS:
        m = _CREATE.match(sql)
        if m is None or m.group(2) in present:
            continue
        kind, name, table = m.groups()
        if kind == "TABLE":
            conn.execute(sql.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))
            temp.add(name)
        elif table in temp:
            conn.execute(sql.replace(f"EXISTS {name}", f"EXISTS temp.{name}", 1))


def _index_names(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' "
        "UNION SELECT name FROM sqlite_temp_master WHERE type = 'index'"
    )
    return {str(name) for (name,) in rows}


def _connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        # mode=ro: a reader never creates the file, whatever the working directory.
        uri = f"file:{quote(str(path.absolute()))}?mode=ro"
        conn = sqlite3.connect(uri, isolation_level=None, check_same_thread=False, timeout=30, uri=True)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    try:
        check_ours(conn, path)
    except BaseException:
        conn.close()
        raise
    if readonly:
        _stand_in_for_missing_tables(conn)
        conn.execute("PRAGMA query_only = ON")
    else:
        _into_wal(conn)
        # FULL: a commit is on disk before the writer reports it (the 250 depends on it).
        conn.execute("PRAGMA synchronous = FULL")
    return conn


def _into_wal(conn: sqlite3.Connection, wait: float = 30.0) -> None:
    """Switching a file into WAL takes an exclusive lock, and SQLite answers "database is
    locked" at once, without its busy handler, while another connection holds the file
    (workers or the CLI opening one new file together): wait as busy_timeout would. Runs in
    the writer's own thread, so the sleep blocks no event loop."""
    execute_waiting(conn, "PRAGMA journal_mode = WAL", wait, 0.005, 0.1)


def execute_waiting(
    conn: sqlite3.Connection,
    sql: str,
    wait: float,
    delay: float,
    most: float,
    busy: tuple[str, ...] = ("locked",),
) -> None:
    """`sql`, tried again while SQLite refuses it at once because another connection holds
    the lock (an error that names one of `busy`): after `delay` seconds, doubling up to
    `most`, until `wait` seconds have gone. It sleeps: call it on a thread, never on the
    event loop."""
    deadline = time.monotonic() + wait
    while True:
        try:
            conn.execute(sql)
            return
        except sqlite3.OperationalError as e:
            if not any(word in str(e) for word in busy) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, most)
