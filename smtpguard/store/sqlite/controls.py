"""Zone controls in SQLite: what its schema does its own way. The rest (pauses, cap usage,
counters, suppression) is written once in store/sql/roles.py."""

from __future__ import annotations

import sqlite3

from smtpguard.policy.limits import HOUR
from smtpguard.store.base import CapUsage
from smtpguard.store.sql import roles
from smtpguard.store.sqlite.access import Access


class Controls(roles.Controls, Access):
    async def user_cap_usage(
        self, zone: str, usernames: list[str], now: float, month: str
    ) -> dict[str, CapUsage]:
        def op(c: sqlite3.Connection) -> dict[str, CapUsage]:
            out = {}
            for user in usernames:
                hour = c.execute(
                    "SELECT COUNT(*) FROM user_sends WHERE zone = ? AND username = ? AND at >= ?",
                    (zone, user, now - HOUR),
                ).fetchone()[0]
                row = c.execute(
                    "SELECT used FROM user_monthly WHERE zone = ? AND username = ? AND month = ?",
                    (zone, user, month),
                ).fetchone()
                out[user] = CapUsage(hour=int(hour), month=int(row[0]) if row else 0)
            return out

        return await self._read(op)

    async def add_counts(self, zone: str, counts: dict[str, int]) -> None:
        def op(c: sqlite3.Connection) -> None:
            c.executemany(
                "INSERT INTO counters (zone, name, value) VALUES (?, ?, ?) "
                "ON CONFLICT (zone, name) DO UPDATE SET value = value + excluded.value",
                [(zone, name, n) for name, n in counts.items()],
            )

        await self._write(op)
