"""Zone controls in SQLite: pauses (zone and class), cap usage, counters, suppression."""

from __future__ import annotations

import sqlite3

from smtpguard.policy.limits import HOUR
from smtpguard.policy.senders import suppression_key
from smtpguard.store.base import (
    CapUsage,
    Suppression,
)
from smtpguard.store.sqlite.access import Access
from smtpguard.store.sqlite.rows import _bump_supp_version


class Controls(Access):
    # --- zones -------------------------------------------------------------------------------
    async def set_paused(self, zone: str, paused: bool) -> None:
        def op(c: sqlite3.Connection) -> None:
            if paused:
                c.execute("INSERT OR IGNORE INTO paused (zone) VALUES (?)", (zone,))
            else:
                c.execute("DELETE FROM paused WHERE zone = ?", (zone,))

        await self._write(op)

    async def is_paused(self, zone: str) -> bool:
        return await self._read(
            lambda c: c.execute("SELECT 1 FROM paused WHERE zone = ?", (zone,)).fetchone() is not None
        )

    async def set_class_paused(self, zone: str, message_class: str, paused: bool) -> None:
        def op(c: sqlite3.Connection) -> None:
            if paused:
                c.execute(
                    "INSERT OR IGNORE INTO paused_classes (zone, class) VALUES (?, ?)", (zone, message_class)
                )
            else:
                c.execute("DELETE FROM paused_classes WHERE zone = ? AND class = ?", (zone, message_class))

        await self._write(op)

    async def paused_classes(self) -> set[tuple[str, str]]:
        def op(c: sqlite3.Connection) -> set[tuple[str, str]]:
            return {(str(z), str(k)) for z, k in c.execute("SELECT zone, class FROM paused_classes")}

        return await self._read(op)

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
        rows = await self._read(
            lambda c: c.execute("SELECT name, value FROM counters WHERE zone = ?", (zone,)).fetchall()
        )
        return {name: int(value) for name, value in rows}

    # --- suppression -------------------------------------------------------------------------
    async def suppressed(self, zone: str, address: str) -> str | None:
        addr = suppression_key(address)

        def op(c: sqlite3.Connection) -> str | None:
            row = c.execute(
                "SELECT zone FROM suppression WHERE address = ? AND zone IN (?, 'global') "
                "ORDER BY zone = 'global' LIMIT 1",
                (addr, zone),
            ).fetchone()
            return str(row[0]) if row else None

        return await self._read(op)

    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        addr = suppression_key(address)

        def op(c: sqlite3.Connection) -> bool:
            added = c.execute(
                "INSERT OR IGNORE INTO suppression (zone, address, reason, at) VALUES (?, ?, ?, ?)",
                (zone, addr, reason, now),
            ).rowcount
            if added:
                _bump_supp_version(c, zone)
            return added == 1

        return await self._write(op)

    async def suppress_remove(self, zone: str, address: str) -> bool:
        addr = suppression_key(address)

        def op(c: sqlite3.Connection) -> bool:
            removed = c.execute(
                "DELETE FROM suppression WHERE zone = ? AND address = ?", (zone, addr)
            ).rowcount
            if removed:
                _bump_supp_version(c, zone)
            return removed == 1

        return await self._write(op)

    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        def op(c: sqlite3.Connection) -> tuple[int, int]:
            rows = dict(
                c.execute("SELECT zone, v FROM supp_versions WHERE zone IN (?, 'global')", (zone,)).fetchall()
            )
            return int(rows.get(zone, 0)), int(rows.get("global", 0))

        return await self._read(op)

    async def suppress_list(self, zone: str) -> list[Suppression]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT zone, address, reason, at FROM suppression WHERE zone = ? ORDER BY address",
                (zone,),
            ).fetchall()
        )
        return [Suppression(z, a, r, float(t)) for z, a, r, t in rows]
