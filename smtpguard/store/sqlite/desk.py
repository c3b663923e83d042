"""The operator's desk in SQLite (DESIGN.md §13, §14): what its schema does its own way.
The rest (finding and listing records, provider events, nonces, the zone audit's writes,
queue depths) is written once in store/sql/roles.py."""

from __future__ import annotations

import sqlite3

from smtpguard.store.base import IdField, StoredEvent, ZoneAudit, id_forms
from smtpguard.store.sql import operations, roles
from smtpguard.store.sql.statements import Plan
from smtpguard.store.sqlite.access import Access


class Desk(roles.Desk, Access):
    def _id_lookup(self, field: IdField, value: str) -> tuple[str, list[str]]:
        # Ids stay in the record's JSON, each with an index on its path (migrations/).
        return f"json_extract({{t}}data, '$.{field}')", id_forms(field, value)

    async def provider_events(self, zone: str, key: str) -> list[StoredEvent]:
        plan = Plan(
            "SELECT data FROM provider_events{indexed provider_events_of_record} "
            "WHERE zone = ? AND key = ? ORDER BY received_at",
            (zone, key),
        )
        return operations.events(await self._rows(plan))

    async def state_counts(self, zone: str) -> dict[str, int]:
        def op(c: sqlite3.Connection) -> list[tuple[str, int]]:
            try:
                return c.execute(
                    "SELECT state, n FROM state_counts WHERE zone = ? AND n > 0", (zone,)
                ).fetchall()
            except sqlite3.OperationalError:
                # A store of an older version, read before serve added the counts.
                older = Plan(
                    "SELECT state, COUNT(*) FROM events{indexed events_zone_state} "
                    "WHERE zone = ? GROUP BY state",
                    (zone,),
                )
                return c.execute(*older.sqlite(self._indexes())).fetchall()

        return {str(state): int(n) for state, n in await self._read(op)}

    async def audit_log(self, zone: str, since: float, limit: int = 1000) -> list[ZoneAudit]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT at, actor, action, key, note FROM zone_audit WHERE zone = ? AND at >= ? "
                "ORDER BY at DESC LIMIT ?",
                (zone, since, limit),
            ).fetchall()
        )
        return [ZoneAudit(float(at), actor, action, key, note) for at, actor, action, key, note in rows]
