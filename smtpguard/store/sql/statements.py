"""A statement written once for both SQL stores, rendered in each one's dialect.

Marks in the text: `?` is a parameter (SQLite's style; PostgreSQL's driver takes `%s`), and
`{bytewise}` follows a column a result is ordered by where PostgreSQL needs COLLATE "C" to
order as SQLite does (byte by byte), whatever the database's default collation.

An operation of several statements is a Script: a generator that yields each Plan (or a
Lock) and is sent the Result, deciding the next step from it, and returns the answer. Each
backend runs it in one transaction of its own (store/sqlite/access.py run_script,
store/postgres/pool.py _run_script); the decisions are written once.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

_BYTEWISE = "{bytewise}"


@dataclass(frozen=True, slots=True)
class Plan:
    sql: str
    params: tuple[Any, ...] = ()

    def sqlite(self) -> tuple[str, tuple[Any, ...]]:
        return self.sql.replace(_BYTEWISE, ""), self.params

    def postgres(self) -> tuple[str, tuple[Any, ...]]:
        # `%` would be read as a parameter by the driver; no shared statement has one.
        assert "%" not in self.sql, self.sql
        return self.sql.replace("?", "%s").replace(_BYTEWISE, ' COLLATE "C"'), self.params


@dataclass(frozen=True, slots=True)
class Lock:
    """The rest of the transaction runs one at a time among those taking `name`. PostgreSQL
    takes a transaction advisory lock; SQLite needs none, its writer's BEGIN IMMEDIATE holds
    the whole file."""

    name: str

    def postgres(self) -> tuple[str, tuple[Any, ...]]:
        return "SELECT pg_advisory_xact_lock(hashtext(%s))", (self.name,)


@dataclass(frozen=True, slots=True)
class Result:
    rows: list[tuple[Any, ...]]
    rowcount: int


Script = Generator[Plan | Lock, Result, T]
