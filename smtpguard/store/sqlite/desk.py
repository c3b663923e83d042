"""The operator's desk in SQLite (DESIGN.md §13, §14): provider events, lookups, lists,
state counts and the zone audit."""

from __future__ import annotations

import json
import sqlite3
import time

from smtpguard.policy.ledger import Record
from smtpguard.store.base import (
    IdField,
    StoredEvent,
    ZoneAudit,
    id_forms,
)
from smtpguard.store.sql import cursors, operations
from smtpguard.store.sqlite.access import Access, run_script
from smtpguard.store.sqlite.rows import _ID_COLUMNS


class Desk(Access):
    # --- provider events ---------------------------------------------------------------------
    async def find_records(self, field: IdField, value: str) -> list[Record]:
        column = _ID_COLUMNS[field]
        forms = id_forms(field, value)

        def op(c: sqlite3.Connection) -> list[Record]:
            marks = ", ".join("?" * len(forms))
            rows = c.execute(
                f"SELECT data FROM events WHERE json_extract(data, '$.{column}') IN ({marks}) LIMIT 100",
                forms,
            ).fetchall()
            return [Record.from_dict(json.loads(row[0])) for row in rows]

        return await self._read(op)

    async def records_for_event(self, field: IdField, value: str) -> list[Record]:
        column = _ID_COLUMNS[field]
        forms = id_forms(field, value)

        def op(c: sqlite3.Connection) -> list[Record]:
            marks = ", ".join("?" * len(forms))
            # The other-zone test is part of the query, before the LIMIT: however many
            # records of one zone hold the id, one record of another zone voids them all.
            rows = c.execute(
                f"SELECT data FROM events WHERE json_extract(data, '$.{column}') IN ({marks}) "
                f"AND NOT EXISTS (SELECT 1 FROM events other "
                f"WHERE json_extract(other.data, '$.{column}') IN ({marks}) AND other.zone <> events.zone) "
                "ORDER BY updated_at DESC LIMIT 100",
                [*forms, *forms],
            ).fetchall()
            return [Record.from_dict(json.loads(row[0])) for row in rows]

        return await self._read(op)

    async def apply_event(self, zone: str, key: str, event: StoredEvent, suppress_reason: str | None) -> bool:
        return await self._write(
            lambda c: run_script(c, operations.apply_event(zone, key, event, suppress_reason))
        )

    async def remember_nonce(self, name: str, digest: str, until: float) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            row = c.execute("SELECT digest, until FROM nonces WHERE name = ?", (name,)).fetchone()
            if row is not None and row[1] >= time.time():
                return bool(row[0] == digest)
            c.execute(
                "INSERT OR REPLACE INTO nonces (name, digest, until) VALUES (?, ?, ?)", (name, digest, until)
            )
            return True

        return await self._write(op)

    async def reconcile_cursor(self, name: str) -> float | None:
        return await self._read(lambda c: run_script(c, cursors.cursor(name)))

    async def advance_reconcile_cursor(self, name: str, expected: float | None, new: float) -> bool:
        return await self._write(lambda c: run_script(c, cursors.advance(name, expected, new)))

    async def provider_events(self, zone: str, key: str) -> list[StoredEvent]:
        rows = await self._read(
            lambda c: c.execute(
                # Without statistics the planner prefers the primary key's zone prefix: a scan
                # of every event of the zone.
                f"SELECT data FROM {self._table('provider_events', 'provider_events_of_record')} "
                "WHERE zone = ? AND key = ? ORDER BY received_at",
                (zone, key),
            ).fetchall()
        )
        return [StoredEvent.from_dict(json.loads(row[0])) for row in rows]

    # --- the operator's desk ------------------------------------------------------------------
    async def list_records(
        self, zone: str, state: str | None, since: float | None, before: float | None, limit: int
    ) -> list[Record]:
        where: list[str] = ["zone = ?"]
        params: list[str | float] = [zone]
        index = "events_zone_updated"
        if state is not None:
            where.append("state = ?")
            params.append(state)
            index = "events_zone_state"
        if since is not None:
            where.append("updated_at >= ?")
            params.append(since)
        if before is not None:
            where.append("updated_at < ?")
            params.append(before)

        def op(c: sqlite3.Connection) -> list[Record]:
            sql = (
                f"SELECT data FROM {self._table('events', index)} WHERE {' AND '.join(where)} "
                "ORDER BY updated_at DESC LIMIT ?"
            )
            rows = c.execute(sql, (*params, limit)).fetchall()
            return [Record.from_dict(json.loads(row[0])) for row in rows]

        return await self._read(op)

    async def state_counts(self, zone: str) -> dict[str, int]:
        def op(c: sqlite3.Connection) -> list[tuple[str, int]]:
            try:
                return c.execute(
                    "SELECT state, n FROM state_counts WHERE zone = ? AND n > 0", (zone,)
                ).fetchall()
            except sqlite3.OperationalError:
                # A store of an older version, read before serve added the counts.
                return c.execute(
                    f"SELECT state, COUNT(*) FROM {self._table('events', 'events_zone_state')} "
                    "WHERE zone = ? GROUP BY state",
                    (zone,),
                ).fetchall()

        return {str(state): int(n) for state, n in await self._read(op)}

    async def audit_add(self, zone: str, entry: ZoneAudit) -> None:
        plan = operations.audit_add(zone, entry)
        await self._write(lambda c: c.execute(*plan.sqlite()))

    async def audit_log(self, zone: str, since: float, limit: int = 1000) -> list[ZoneAudit]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT at, actor, action, key, note FROM zone_audit WHERE zone = ? AND at >= ? "
                "ORDER BY at DESC LIMIT ?",
                (zone, since, limit),
            ).fetchall()
        )
        return [ZoneAudit(float(at), actor, action, key, note) for at, actor, action, key, note in rows]
