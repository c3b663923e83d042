"""Zone controls in PostgreSQL: pauses (zone and class), cap usage, counters, suppression.
What both SQL stores do alike is written once in store/sql/operations.py."""

from __future__ import annotations

from smtpguard.policy.limits import HOUR
from smtpguard.store.base import CapUsage, Suppression
from smtpguard.store.postgres.pool import Pool, _one, _run_script, _translated
from smtpguard.store.sql import operations


class Controls(Pool):
    # --- zones -------------------------------------------------------------------------------
    @_translated
    async def set_paused(self, zone: str, paused: bool) -> None:
        async with self._conn() as conn:
            await conn.execute(*operations.set_paused(zone, paused).postgres())

    @_translated
    async def is_paused(self, zone: str) -> bool:
        async with self._conn() as conn:
            return await _one(conn, *operations.is_paused(zone).postgres()) is not None

    @_translated
    async def set_class_paused(self, zone: str, message_class: str, paused: bool) -> None:
        async with self._conn() as conn:
            await conn.execute(*operations.set_class_paused(zone, message_class, paused).postgres())

    @_translated
    async def paused_classes(self) -> set[tuple[str, str]]:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.PAUSED_CLASSES.postgres())
            return operations.paused_classes(await cur.fetchall())

    @_translated
    async def user_cap_usage(
        self, zone: str, usernames: list[str], now: float, month: str
    ) -> dict[str, CapUsage]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT u, "
                "(SELECT count(*) FROM user_sends WHERE zone = %s AND username = u AND at >= %s), "
                "(SELECT used FROM user_monthly WHERE zone = %s AND username = u AND month = %s) "
                "FROM unnest(%s::text[]) AS names(u)",
                (zone, now - HOUR, zone, month, list(usernames)),
            )
            return {str(u): CapUsage(hour=int(h), month=int(m or 0)) for u, h, m in await cur.fetchall()}

    @_translated
    async def cap_usage(self, zone: str, now: float, month: str) -> CapUsage:
        async with self._conn() as conn:
            row = await _one(
                conn,
                "SELECT (SELECT count(*) FROM sends WHERE zone = %s AND at >= %s), "
                "(SELECT sum(used) FROM monthly WHERE zone = %s AND month = %s)",
                (zone, now - HOUR, zone, month),
            )
        assert row is not None
        return CapUsage(hour=int(row[0]), month=int(row[1] or 0))

    @_translated
    async def add_counts(self, zone: str, counts: dict[str, int]) -> None:
        if not counts:
            return
        async with self._conn() as conn:
            # One statement: the names sorted, so two concurrent calls lock rows in one order.
            names = sorted(counts)
            await conn.execute(
                "INSERT INTO counters (zone, name, value) "
                "SELECT %s, n, v FROM unnest(%s::text[], %s::bigint[]) AS c(n, v) "
                "ON CONFLICT (zone, name) DO UPDATE SET value = counters.value + excluded.value",
                (zone, names, [counts[n] for n in names]),
            )

    @_translated
    async def counts(self, zone: str) -> dict[str, int]:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.counters(zone).postgres())
            return operations.counts(await cur.fetchall())

    # --- suppression -------------------------------------------------------------------------
    @_translated
    async def suppressed(self, zone: str, address: str) -> str | None:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.suppressed(zone, address).postgres())
            return operations.listed_in(await cur.fetchall())

    @_translated
    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        async with self._tx() as conn:
            return await _run_script(conn, operations.suppress_add(zone, address, reason, now))

    @_translated
    async def suppress_remove(self, zone: str, address: str) -> bool:
        async with self._tx() as conn:
            return await _run_script(conn, operations.suppress_remove(zone, address))

    @_translated
    async def suppress_list(self, zone: str) -> list[Suppression]:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.suppress_list(zone).postgres())
            return operations.suppressions(await cur.fetchall())

    @_translated
    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.suppression_versions(zone).postgres())
            return operations.versions(await cur.fetchall(), zone)
