"""A statement written once for both SQL stores, rendered in each one's dialect.

Marks in the text: `?` is a parameter (SQLite's style; PostgreSQL's driver takes `%s`),
`{bytewise}` follows a column a result is ordered by where PostgreSQL needs COLLATE "C" to
order as SQLite does (byte by byte), whatever the database's default collation, and
`{indexed NAME}` follows a table SQLite is to read through index NAME: without statistics
its planner prefers the primary key's zone prefix, a scan of every row of the zone. The
hint is left out where the file has no such index (a store of an older version, read before
`serve` upgraded it) and for PostgreSQL, whose planner has statistics. `{number
COLUMN.KEY}` reads the number at KEY of the JSON object COLUMN holds as text: NULL where
the key is absent or null, in both dialects.

An operation of several statements is a Script: a generator that yields each Plan (or a
Lock) and is sent the Result, deciding the next step from it, and returns the answer. Each
backend runs it in one transaction of its own (store/sqlite/access.py run_script,
store/postgres/pool.py _run_script); the decisions are written once.
"""

from __future__ import annotations

import re
from collections.abc import Container, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_BYTEWISE = "{bytewise}"
_INDEXED = re.compile(r"\{indexed ([a-z_]+)\}")
_NUMBER = re.compile(r"\{number ([a-z_.]+)\.([a-z_]+)\}")


@dataclass(frozen=True, slots=True)
class Plan:
    sql: str
    params: tuple[Any, ...] = ()

    def sqlite(self, indexes: Container[str] = frozenset()) -> tuple[str, tuple[Any, ...]]:
        """The statement for SQLite, on a file holding `indexes`."""
        sql = _INDEXED.sub(lambda m: f" INDEXED BY {m[1]}" if m[1] in indexes else "", self.sql)
        sql = _NUMBER.sub(lambda m: f"json_extract({m[1]}, '$.{m[2]}')", sql)
        return sql.replace(_BYTEWISE, ""), self.params

    def postgres(self) -> tuple[str, tuple[Any, ...]]:
        # `%` would be read as a parameter by the driver; no shared statement has one.
        assert "%" not in self.sql, self.sql
        sql = _INDEXED.sub("", self.sql)
        sql = _NUMBER.sub(lambda m: f"({m[1]}::json->>'{m[2]}')::float8", sql)
        return sql.replace("?", "%s").replace(_BYTEWISE, ' COLLATE "C"'), self.params


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


@dataclass(frozen=True, slots=True)
class Done(Generic[T]):
    """A script has finished: its answer."""

    value: T


def advance(script: Script[T], result: Result | None) -> Plan | Lock | Done[T]:
    """The script's next step, once sent the result of its last (None: it has not started),
    or Done with its answer: the stepping both backends' runners share."""
    try:
        return next(script) if result is None else script.send(result)
    except StopIteration as done:
        return Done(done.value)
