"""What every role of the SQLite store reaches the file through: one writer, a pool of
readers."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from smtpguard.store.base import StoreUnavailable
from smtpguard.store.sql.roles import Runner
from smtpguard.store.sql.statements import Done, Lock, Plan, Result, Script, advance
from smtpguard.store.sqlite.schema import _connect, _index_names
from smtpguard.store.sqlite.writer import _Writer

T = TypeVar("T")
P = ParamSpec("P")


class Access(Runner):
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

    def _indexes(self) -> set[str]:
        """The indexes of the file this reader thread reads (statements.py `{indexed}`)."""
        indexes: set[str] = getattr(self._local, "indexes", set())
        return indexes

    # --- the shared roles' runner (store/sql/roles.py) ----------------------------------------
    async def _rows(self, plan: Plan) -> list[tuple[Any, ...]]:
        return await self._read(lambda c: c.execute(*plan.sqlite(self._indexes())).fetchall())

    async def _execute(self, plan: Plan) -> None:
        def op(c: sqlite3.Connection) -> None:
            c.execute(*plan.sqlite())

        await self._write(op)

    async def _script(self, make: Callable[P, Script[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._write(lambda c: run_script(c, make(*args, **kwargs)))


def run_script(c: sqlite3.Connection, script: Script[T]) -> T:
    """A shared operation of several statements (store/sql/), inside the writer's
    transaction."""
    step = advance(script, None)
    while not isinstance(step, Done):
        if isinstance(step, Lock):
            step = advance(script, Result([], 0))  # BEGIN IMMEDIATE holds the file already
            continue
        cursor = c.execute(*step.sqlite())
        step = advance(script, Result(cursor.fetchall(), cursor.rowcount))
    return step.value
