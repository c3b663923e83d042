"""What every role of the SQLite store reaches the file through: one writer, a pool of
readers."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from smtpguard.store.base import StoreUnavailable
from smtpguard.store.sql.statements import Lock, Result, Script
from smtpguard.store.sqlite.schema import _connect, _index_names
from smtpguard.store.sqlite.writer import _Writer

T = TypeVar("T")


class Access:
    """The writer and the readers every role's operations go through."""

    path: Path
    read_only: bool
    _writer: _Writer | None
    _readers: ThreadPoolExecutor | None
    _local: threading.local

    def _write(self, fn: Callable[[sqlite3.Connection], T], heavy: bool = False) -> asyncio.Future[T]:
        if self._writer is None:
            raise StoreUnavailable("store is opened read-only" if self.read_only else "store is not open")
        return self._writer.submit(fn, heavy)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._readers is None:
            raise StoreUnavailable("store is not open")

        def run() -> T:
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = _connect(self.path, readonly=True)
                self._local.indexes = _index_names(conn)
                self._local.conn = conn
            return fn(conn)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._readers, run)
        except sqlite3.Error as e:
            raise StoreUnavailable(f"sqlite read failed: {e}") from e

    def _table(self, table: str, index: str) -> str:
        """`table INDEXED BY index`, or just `table` where the index is not there (a store
        of an older version, read before `serve` has upgraded it). On a reader thread only."""
        indexes: set[str] = getattr(self._local, "indexes", set())
        return f"{table} INDEXED BY {index}" if index in indexes else table


def run_script(c: sqlite3.Connection, script: Script[T]) -> T:
    """A shared operation of several statements (store/sql/), inside the writer's
    transaction."""
    result: Result | None = None
    while True:
        try:
            step = next(script) if result is None else script.send(result)
        except StopIteration as done:
            answer: T = done.value
            return answer
        if isinstance(step, Lock):
            result = Result([], 0)  # BEGIN IMMEDIATE holds the file already
        else:
            cursor = c.execute(*step.sqlite())
            result = Result(cursor.fetchall(), cursor.rowcount)
