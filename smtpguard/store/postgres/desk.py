"""Provider events, webhook nonces and the operator's desk in PostgreSQL."""

from __future__ import annotations

import json

from smtpguard.policy.events import bare_message_id
from smtpguard.policy.ledger import Record
from smtpguard.store.base import IdField, StoredEvent, ZoneAudit
from smtpguard.store.postgres.pool import Pool, _one, _run_script, _translated
from smtpguard.store.sql import cursors, operations


class Desk(Pool):
    # --- provider events ---------------------------------------------------------------------
    @_translated
    async def find_records(self, field: IdField, value: str) -> list[Record]:
        if field == "message_id":
            sql, wanted = "SELECT data FROM events WHERE mid = %s LIMIT 100", bare_message_id(value)
        elif field == "sg_id":
            sql = 'SELECT data FROM events WHERE substring(data from \'"sg_id":"([^"]*)"\') = %s LIMIT 100'
            wanted = value.strip()
        else:
            sql, wanted = "SELECT data FROM events WHERE uid = %s LIMIT 100", value.strip()
        async with self._conn() as conn:
            cur = await conn.execute(sql, (wanted,))
            return [Record.from_dict(json.loads(data)) for (data,) in await cur.fetchall()]

    @_translated
    async def records_for_event(self, field: IdField, value: str) -> list[Record]:
        if field == "message_id":
            column, wanted = "{t}.mid", bare_message_id(value)
        elif field == "sg_id":
            column, wanted = 'substring({t}.data from \'"sg_id":"([^"]*)"\')', value.strip()
        else:
            column, wanted = "{t}.uid", value.strip()
        # The other-zone test is part of the query, before the LIMIT (DESIGN.md §18).
        sql = (
            f"SELECT e.data FROM events e WHERE {column.format(t='e')} = %s AND NOT EXISTS "
            f"(SELECT 1 FROM events o WHERE {column.format(t='o')} = %s AND o.zone <> e.zone) "
            "ORDER BY e.updated_at DESC LIMIT 100"
        )
        async with self._conn() as conn:
            cur = await conn.execute(sql, (wanted, wanted))
            return [Record.from_dict(json.loads(data)) for (data,) in await cur.fetchall()]

    @_translated
    async def apply_event(self, zone: str, key: str, event: StoredEvent, suppress_reason: str | None) -> bool:
        async with self._tx() as conn:
            return await _run_script(conn, operations.apply_event(zone, key, event, suppress_reason))

    @_translated
    async def reconcile_cursor(self, name: str) -> float | None:
        async with self._conn() as conn:
            return await _run_script(conn, cursors.cursor(name))

    @_translated
    async def advance_reconcile_cursor(self, name: str, expected: float | None, new: float) -> bool:
        async with self._tx() as conn:
            return await _run_script(conn, cursors.advance(name, expected, new))

    @_translated
    async def provider_events(self, zone: str, key: str) -> list[StoredEvent]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT data FROM provider_events WHERE zone = %s AND key = %s ORDER BY received_at, seq",
                (zone, key),
            )
            return [StoredEvent.from_dict(json.loads(data)) for (data,) in await cur.fetchall()]

    @_translated
    async def remember_nonce(self, name: str, digest: str, until: float) -> bool:
        async with self._tx() as conn:
            # An expired nonce is free again; a live one answers by its digest.
            row = await _one(
                conn,
                "INSERT INTO nonces (name, digest, until) VALUES (%s, %s, %s) "
                "ON CONFLICT (name) DO UPDATE SET digest = excluded.digest, until = excluded.until "
                "WHERE nonces.until < %s RETURNING digest",
                (name, digest, until, self.now()),
            )
            if row is not None:
                return True
            current = await _one(conn, "SELECT digest FROM nonces WHERE name = %s", (name,))
            return current is not None and current[0] == digest

    # --- the operator's desk ------------------------------------------------------------------
    @_translated
    async def list_records(
        self, zone: str, state: str | None, since: float | None, before: float | None, limit: int
    ) -> list[Record]:
        where: list[str] = ["zone = %s"]
        params: list[str | float] = [zone]
        if state is not None:
            where.append("state = %s")
            params.append(state)
        if since is not None:
            where.append("updated_at >= %s")
            params.append(since)
        if before is not None:
            where.append("updated_at < %s")
            params.append(before)
        sql = f"SELECT data FROM events WHERE {' AND '.join(where)} ORDER BY updated_at DESC LIMIT %s"
        async with self._conn() as conn:
            cur = await conn.execute(sql, (*params, limit))
            return [Record.from_dict(json.loads(data)) for (data,) in await cur.fetchall()]

    @_translated
    async def state_counts(self, zone: str) -> dict[str, int]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT state, count(*) FROM events WHERE zone = %s GROUP BY state", (zone,)
            )
            return {str(state): int(n) for state, n in await cur.fetchall()}

    @_translated
    async def audit_add(self, zone: str, entry: ZoneAudit) -> None:
        async with self._conn() as conn:
            await conn.execute(*operations.audit_add(zone, entry).postgres())

    @_translated
    async def audit_log(self, zone: str, since: float, limit: int = 1000) -> list[ZoneAudit]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT at, actor, action, key, note FROM zone_audit WHERE zone = %s AND at >= %s "
                "ORDER BY at DESC, seq DESC LIMIT %s",
                (zone, since, limit),
            )
            return [ZoneAudit(float(at), a, act, k, n) for at, a, act, k, n in await cur.fetchall()]

    @_translated
    async def queue_depths(self) -> dict[tuple[str, str], int]:
        async with self._conn() as conn:
            cur = await conn.execute(*operations.QUEUE_DEPTHS.postgres())
            return operations.queue_depths(await cur.fetchall())
