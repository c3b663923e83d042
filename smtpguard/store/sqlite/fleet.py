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
from smtpguard.store.sqlite.access import Access, run_script


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
        rows = await self._read(lambda c: c.execute(*operations.throttled(now).sqlite()).fetchall())
        return operations.throttles(rows)

    async def hold_connection(self, provider: str, holder: str, limit: int, until: float, now: float) -> bool:
        return await self._write(
            lambda c: run_script(c, operations.hold_connection(provider, holder, limit, until, now))
        )

    async def drop_connection(self, provider: str, holder: str) -> None:
        await self._write(lambda c: c.execute(*operations.drop_connection(provider, holder).sqlite()))

    # --- AUTH brute force --------------------------------------------------------------------
    async def auth_failure(self, ip: str, now: float, window: float) -> int:
        return await self._write(lambda c: run_script(c, operations.auth_failure(ip, now, window)))

    async def auth_failures(self, ip: str, now: float, window: float) -> int:
        plan = operations.auth_failures(ip, now, window)
        return await self._read(lambda c: operations.count(c.execute(*plan.sqlite()).fetchall()))
