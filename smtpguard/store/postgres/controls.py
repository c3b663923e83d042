"""Zone controls in PostgreSQL: pauses (zone and class), cap usage, counters, suppression."""

from __future__ import annotations

from smtpguard.policy.limits import HOUR
from smtpguard.policy.senders import suppression_key
from smtpguard.store.base import CapUsage, Suppression
from smtpguard.store.postgres.pool import Conn, Pool, _one, _translated


class Controls(Pool):
    # --- zones -------------------------------------------------------------------------------
    @_translated
    async def set_paused(self, zone: str, paused: bool) -> None:
        async with self._conn() as conn:
            if paused:
                await conn.execute("INSERT INTO paused (zone) VALUES (%s) ON CONFLICT DO NOTHING", (zone,))
            else:
                await conn.execute("DELETE FROM paused WHERE zone = %s", (zone,))

    @_translated
    async def is_paused(self, zone: str) -> bool:
        async with self._conn() as conn:
            return await _one(conn, "SELECT 1 FROM paused WHERE zone = %s", (zone,)) is not None

    @_translated
    async def set_class_paused(self, zone: str, message_class: str, paused: bool) -> None:
        async with self._conn() as conn:
            if paused:
                await conn.execute(
                    "INSERT INTO paused_classes (zone, class) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                    (zone, message_class),
                )
            else:
                await conn.execute(
                    "DELETE FROM paused_classes WHERE zone = %s AND class = %s", (zone, message_class)
                )

    @_translated
    async def paused_classes(self) -> set[tuple[str, str]]:
        async with self._conn() as conn:
            cur = await conn.execute("SELECT zone, class FROM paused_classes")
            return {(str(z), str(c)) for z, c in await cur.fetchall()}

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
            cur = await conn.execute("SELECT name, value FROM counters WHERE zone = %s", (zone,))
            return {str(name): int(value) for name, value in await cur.fetchall()}

    # --- suppression -------------------------------------------------------------------------
    @_translated
    async def suppressed(self, zone: str, address: str) -> str | None:
        async with self._conn() as conn:
            row = await _one(
                conn,
                "SELECT zone FROM suppression WHERE address = %s AND zone IN (%s, 'global') "
                "ORDER BY zone = 'global' LIMIT 1",
                (suppression_key(address), zone),
            )
        return str(row[0]) if row else None

    @_translated
    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        async with self._tx() as conn:
            return await _list(conn, zone, suppression_key(address), reason, now)

    @_translated
    async def suppress_remove(self, zone: str, address: str) -> bool:
        async with self._tx() as conn:
            gone = await _one(
                conn,
                "DELETE FROM suppression WHERE zone = %s AND address = %s RETURNING 1",
                (zone, suppression_key(address)),
            )
            if gone is not None:
                await _bump_supp_version(conn, zone)
            return gone is not None

    @_translated
    async def suppress_list(self, zone: str) -> list[Suppression]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT zone, address, reason, at FROM suppression WHERE zone = %s "
                'ORDER BY address COLLATE "C"',
                (zone,),
            )
            return [Suppression(str(z), str(a), str(r), float(t)) for z, a, r, t in await cur.fetchall()]

    @_translated
    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT zone, v FROM supp_versions WHERE zone IN (%s, 'global')", (zone,)
            )
            rows = {str(z): int(v) for z, v in await cur.fetchall()}
        return rows.get(zone, 0), rows.get("global", 0)


async def _list(conn: Conn, zone: str, address: str, reason: str, at: float) -> bool:
    added = await _one(
        conn,
        "INSERT INTO suppression (zone, address, reason, at) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING RETURNING 1",
        (zone, address, reason, at),
    )
    if added is not None:
        await _bump_supp_version(conn, zone)
    return added is not None


async def _bump_supp_version(conn: Conn, zone: str) -> None:
    await conn.execute(
        "INSERT INTO supp_versions (zone, v) VALUES (%s, 1) "
        "ON CONFLICT (zone) DO UPDATE SET v = supp_versions.v + 1",
        (zone,),
    )
