"""The fleet in SQLite (DESIGN.md §15, §16): provider health, throttling and AUTH failures
shared by every instance."""

from __future__ import annotations

import sqlite3

from smtpguard.policy.throttle import Slot, gcra
from smtpguard.store.base import (
    CircuitState,
    ProbeState,
)
from smtpguard.store.sql import operations
from smtpguard.store.sqlite.access import Access


class Fleet(Access):
    # --- provider health ---------------------------------------------------------------------
    async def set_circuit(self, instance: str, provider: str, circuit: str, now: float) -> None:
        plan = operations.set_circuit(instance, provider, circuit, now)
        await self._write(lambda c: c.execute(*plan.sqlite()))

    async def circuits(self) -> list[CircuitState]:
        rows = await self._read(lambda c: c.execute(*operations.CIRCUITS.sqlite()).fetchall())
        return operations.circuits(rows)

    async def set_probe(self, instance: str, provider: str, ready: bool, detail: str, now: float) -> None:
        plan = operations.set_probe(instance, provider, ready, detail, now)
        await self._write(lambda c: c.execute(*plan.sqlite()))

    async def probes(self) -> list[ProbeState]:
        rows = await self._read(lambda c: c.execute(*operations.PROBES.sqlite()).fetchall())
        return operations.probes(rows)

    # --- provider throttling -----------------------------------------------------------------
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

    async def throttled(self, now: float) -> dict[str, float]:
        rows = await self._read(
            lambda c: c.execute("SELECT provider, until FROM throttles WHERE until > ?", (now,)).fetchall()
        )
        return {str(p): float(u) for p, u in rows}

    async def hold_connection(self, provider: str, holder: str, limit: int, until: float, now: float) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            c.execute("DELETE FROM connection_slots WHERE provider = ? AND until <= ?", (provider, now))
            mine = c.execute(
                "UPDATE connection_slots SET until = ? WHERE provider = ? AND holder = ?",
                (until, provider, holder),
            ).rowcount
            if mine:
                return True
            held = c.execute(
                "SELECT COUNT(*) FROM connection_slots WHERE provider = ?", (provider,)
            ).fetchone()[0]
            if int(held) >= limit:
                return False
            c.execute(
                "INSERT INTO connection_slots (provider, holder, until) VALUES (?, ?, ?)",
                (provider, holder, until),
            )
            return True

        return await self._write(op)

    async def drop_connection(self, provider: str, holder: str) -> None:
        await self._write(
            lambda c: c.execute(
                "DELETE FROM connection_slots WHERE provider = ? AND holder = ?", (provider, holder)
            )
        )

    # --- AUTH brute force --------------------------------------------------------------------
    async def auth_failure(self, ip: str, now: float, window: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            c.execute("INSERT INTO auth_failures (ip, at) VALUES (?, ?)", (ip, now))
            return int(
                c.execute(
                    "SELECT COUNT(*) FROM auth_failures WHERE ip = ? AND at > ?", (ip, now - window)
                ).fetchone()[0]
            )

        return await self._write(op)

    async def auth_failures(self, ip: str, now: float, window: float) -> int:
        return await self._read(
            lambda c: int(
                c.execute(
                    "SELECT COUNT(*) FROM auth_failures WHERE ip = ? AND at > ?", (ip, now - window)
                ).fetchone()[0]
            )
        )
