"""The fleet in PostgreSQL (DESIGN.md §15, §16): what its schema does its own way. The rest
(provider health, connection slots, AUTH failures) is written once in store/sql/roles.py."""

from __future__ import annotations

from smtpguard.policy.throttle import gcra
from smtpguard.store.base import Slot
from smtpguard.store.postgres.pool import Pool, _one, _translated
from smtpguard.store.sql import roles


class Fleet(roles.Fleet, Pool):
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
