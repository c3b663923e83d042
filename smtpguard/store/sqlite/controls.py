"""Zone controls in SQLite: pauses (zone and class), cap usage, counters, suppression.
What both SQL stores do alike is written once in store/sql/operations.py."""

from __future__ import annotations

import sqlite3

from smtpguard.policy.limits import HOUR
from smtpguard.store.base import (
    CapUsage,
    Suppression,
)
from smtpguard.store.sql import operations
from smtpguard.store.sqlite.access import Access, run_script


class Controls(Access):
    # --- zones -------------------------------------------------------------------------------
    async def set_paused(self, zone: str, paused: bool) -> None:
        plan = operations.set_paused(zone, paused)
        await self._write(lambda c: c.execute(*plan.sqlite()))

    async def is_paused(self, zone: str) -> bool:
        plan = operations.is_paused(zone)
        return await self._read(lambda c: c.execute(*plan.sqlite()).fetchone() is not None)

    async def set_class_paused(self, zone: str, message_class: str, paused: bool) -> None:
        plan = operations.set_class_paused(zone, message_class, paused)
        await self._write(lambda c: c.execute(*plan.sqlite()))

    async def paused_classes(self) -> set[tuple[str, str]]:
        rows = await self._read(lambda c: c.execute(*operations.PAUSED_CLASSES.sqlite()).fetchall())
        return operations.paused_classes(rows)

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

    async def cap_usage(self, zone: str, now: float, month: str) -> CapUsage:
        def op(c: sqlite3.Connection) -> CapUsage:
            hour = c.execute(
                "SELECT COUNT(*) FROM sends WHERE zone = ? AND at >= ?", (zone, now - HOUR)
            ).fetchone()[0]
            row = c.execute("SELECT used FROM monthly WHERE zone = ? AND month = ?", (zone, month)).fetchone()
            return CapUsage(hour=int(hour), month=int(row[0]) if row else 0)

        return await self._read(op)

    async def add_counts(self, zone: str, counts: dict[str, int]) -> None:
        def op(c: sqlite3.Connection) -> None:
            c.executemany(
                "INSERT INTO counters (zone, name, value) VALUES (?, ?, ?) "
                "ON CONFLICT (zone, name) DO UPDATE SET value = value + excluded.value",
                [(zone, name, n) for name, n in counts.items()],
            )

        await self._write(op)

    async def counts(self, zone: str) -> dict[str, int]:
        plan = operations.counters(zone)
        rows = await self._read(lambda c: c.execute(*plan.sqlite()).fetchall())
        return operations.counts(rows)

    # --- suppression -------------------------------------------------------------------------
    async def suppressed(self, zone: str, address: str) -> str | None:
        plan = operations.suppressed(zone, address)
        rows = await self._read(lambda c: c.execute(*plan.sqlite()).fetchall())
        return operations.listed_in(rows)

    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        return await self._write(lambda c: run_script(c, operations.suppress_add(zone, address, reason, now)))

    async def suppress_remove(self, zone: str, address: str) -> bool:
        return await self._write(lambda c: run_script(c, operations.suppress_remove(zone, address)))

    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        plan = operations.suppression_versions(zone)
        rows = await self._read(lambda c: c.execute(*plan.sqlite()).fetchall())
        return operations.versions(rows, zone)

    async def suppress_list(self, zone: str) -> list[Suppression]:
        plan = operations.suppress_list(zone)
        rows = await self._read(lambda c: c.execute(*plan.sqlite()).fetchall())
        return operations.suppressions(rows)
