"""What a file must be before the writer changes anything in it: writable by this process.
A failure is StoreUnfit naming the file and the reason: `serve` exits 1 rather than start
on a store that answers every submission 451 4.3.0 while systemd and /readyz call it ready."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from smtpguard.store.base import StoreUnfit
from smtpguard.store.sqlite.migrate import schema_version

_SQLITE_READONLY = 8
_SQLITE_CANTOPEN = 14


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
