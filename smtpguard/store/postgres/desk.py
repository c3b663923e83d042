"""The operator's desk in PostgreSQL (DESIGN.md §13, §14): what its schema does its own way
(ids in columns of their own, a sequence breaking ties of time). The rest (finding and
listing records, provider events, nonces, the zone audit's writes, queue depths) is written
once in store/sql/roles.py."""

from __future__ import annotations

from smtpguard.policy.events import bare_message_id
from smtpguard.store.base import IdField, StoredEvent, ZoneAudit
from smtpguard.store.postgres.pool import Pool, _translated
from smtpguard.store.sql import operations, roles

ID_COLUMNS: dict[IdField, str] = {
    "message_id": "{t}mid",  # bare, without its angle brackets (rows.py _ids)
    "sg_id": 'substring({t}data from \'"sg_id":"([^"]*)"\')',
    "upstream_id": "{t}uid",
}


def id_lookup(field: IdField, value: str) -> tuple[str, list[str]]:
    """Where a record's `field` is kept, and the one form `value` stands there in."""
    return ID_COLUMNS[field], [bare_message_id(value) if field == "message_id" else value.strip()]


class Desk(roles.Desk, Pool):
    def _id_lookup(self, field: IdField, value: str) -> tuple[str, list[str]]:
        return id_lookup(field, value)

    @_translated
    async def provider_events(self, zone: str, key: str) -> list[StoredEvent]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT data FROM provider_events WHERE zone = %s AND key = %s ORDER BY received_at, seq",
                (zone, key),
            )
            return operations.events(await cur.fetchall())

    @_translated
    async def state_counts(self, zone: str) -> dict[str, int]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT state, count(*) FROM events WHERE zone = %s GROUP BY state", (zone,)
            )
            return {str(state): int(n) for state, n in await cur.fetchall()}

    @_translated
    async def audit_log(self, zone: str, since: float, limit: int = 1000) -> list[ZoneAudit]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT at, actor, action, key, note FROM zone_audit WHERE zone = %s AND at >= %s "
                "ORDER BY at DESC, seq DESC LIMIT %s",
                (zone, since, limit),
            )
            return [ZoneAudit(float(at), a, act, k, n) for at, a, act, k, n in await cur.fetchall()]
