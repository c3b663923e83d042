"""The fleet in PostgreSQL (DESIGN.md §15, §16): provider health, throttling and AUTH
failures shared by every instance."""

from __future__ import annotations

from smtpguard.policy.throttle import gcra
from smtpguard.store.base import CircuitState, ProbeState, Slot
from smtpguard.store.postgres.pool import Pool, _one, _run_script, _translated
from smtpguard.store.sql import operations


class Fleet(Pool):
    # --- provider probes (DESIGN.md §12) ------------------------------------------------------
    @_translated
    async def set_probe(self, instance: str, provider: str, ready: bool, detail: str, now: float) -> None:
        async with self._conn() as conn:
            await conn.execute(*operations.set_probe(instance, provider, ready, detail, now).postgres())

    @_translated
    async def probes(self) -> list[ProbeState]:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.PROBES.postgres())
            return operations.probes(await cur.fetchall())

    # --- provider health ---------------------------------------------------------------------
    @_translated
    async def set_circuit(self, instance: str, provider: str, circuit: str, now: float) -> None:
        async with self._conn() as conn:
            await conn.execute(*operations.set_circuit(instance, provider, circuit, now).postgres())

    @_translated
    async def circuits(self) -> list[CircuitState]:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.CIRCUITS.postgres())
            return operations.circuits(await cur.fetchall())

    # --- provider throttling -----------------------------------------------------------------
    @_translated
    async def rate_slot(self, provider: str, interval: float, max_wait: float, now: float) -> Slot:
        async with self._tx() as conn:
            # The row lock orders concurrent callers: each decides on the slot the last left.
            await conn.execute(
                "INSERT INTO rate_slots (provider, tat) VALUES (%s, 0) ON CONFLICT DO NOTHING", (provider,)
            )
            row = await _one(conn, "SELECT tat FROM rate_slots WHERE provider = %s FOR UPDATE", (provider,))
            assert row is not None
            slot = gcra(float(row[0]), now, interval, max_wait)
            if slot.granted or slot.tat != float(row[0]):
                await conn.execute("UPDATE rate_slots SET tat = %s WHERE provider = %s", (slot.tat, provider))
        return slot

    @_translated
    async def set_throttled(self, provider: str, until: float) -> None:
        async with self._conn() as conn:
            await conn.execute(
                "INSERT INTO throttles (provider, until) VALUES (%s, %s) ON CONFLICT (provider) "
                "DO UPDATE SET until = greatest(throttles.until, excluded.until)",
                (provider, until),
            )

    @_translated
    async def throttled(self, now: float) -> dict[str, float]:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.throttled(now).postgres())
            return operations.throttles(await cur.fetchall())

    @_translated
    async def hold_connection(self, provider: str, holder: str, limit: int, until: float, now: float) -> bool:
        async with self._tx() as conn:
            return await _run_script(conn, operations.hold_connection(provider, holder, limit, until, now))

    @_translated
    async def drop_connection(self, provider: str, holder: str) -> None:
        async with self._conn() as conn:
            await conn.execute(*operations.drop_connection(provider, holder).postgres())

    # --- AUTH brute force --------------------------------------------------------------------
    @_translated
    async def auth_failure(self, ip: str, now: float, window: float) -> int:
        async with self._tx() as conn:
            return await _run_script(conn, operations.auth_failure(ip, now, window))

    @_translated
    async def auth_failures(self, ip: str, now: float, window: float) -> int:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.auth_failures(ip, now, window).postgres())
            return operations.count(await cur.fetchall())
