"""Zone controls in PostgreSQL: what its schema does its own way (it takes arrays). The rest
(pauses, cap usage, counters, suppression) is written once in store/sql/roles.py."""

from __future__ import annotations

from smtpguard.policy.limits import HOUR
from smtpguard.store.base import CapUsage
from smtpguard.store.postgres.pool import Pool, _translated
from smtpguard.store.sql import roles


class Controls(roles.Controls, Pool):
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
