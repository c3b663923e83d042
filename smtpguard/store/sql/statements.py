"""A statement written once for both SQL stores, rendered in each one's dialect.

Marks in the text: `?` is a parameter (SQLite's style; PostgreSQL's driver takes `%s`), and
`{bytewise}` follows a column a result is ordered by where PostgreSQL needs COLLATE "C" to
order as SQLite does (byte by byte), whatever the database's default collation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
