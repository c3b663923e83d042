"""The fleet in SQLite (DESIGN.md §15, §16): what its schema does its own way. The rest
(provider health, connection slots, AUTH failures) is written once in store/sql/roles.py."""

from __future__ import annotations

import sqlite3

from smtpguard.policy.throttle import Slot, gcra
from smtpguard.store.sql import roles
from smtpguard.store.sqlite.access import Access


class Fleet(roles.Fleet, Access):
    async def rate_slot(self, provider: str, interval: float, max_wait: float, now: float) -> Slot:
        def op(c: sqlite3.Connection) -> Slot:
            # Inside the writer's BEGIN IMMEDIATE: other processes on the file wait for it.
            row = c.execute("SELECT tat FROM rate_slots WHERE provider = ?", (provider,)).fetchone()
            slot = gcra(float(row[0]) if row else None, now, interval, max_wait)
            if slot.granted or (row is not None and slot.tat != float(row[0])):
                c.execute(
                    "INSERT OR REPLACE INTO rate_slots (provider, tat) VALUES (?, ?)", (provider, slot.tat)
                )
            return slot

        return await self._write(op)

    async def set_throttled(self, provider: str, until: float) -> None:
        await self._write(
            lambda c: c.execute(
                "INSERT INTO throttles (provider, until) VALUES (?, ?) "
                "ON CONFLICT (provider) DO UPDATE SET until = max(until, excluded.until)",
                (provider, until),
            )
        )
