"""PostgreSQL backend: the store for a fleet, one that survives a failover (DESIGN.md §15).

`postgresql://user@host1,host2/db?target_session_attrs=read-write` is handed to libpq as it
is (psycopg 3 speaks libpq), so multi-host URLs, `target_session_attrs` and every other
connection parameter mean what PostgreSQL's own documentation says. A pool keeps the
connections; one that dies with its server is dropped, and the next one libpq makes finds
the read-write server among the hosts: after a failover new sessions reach the new primary
without a restart.

Atomicity is the server's. The reservation is one statement, a function the migration
creates (`smtpguard_reserve`): `INSERT … ON CONFLICT DO NOTHING` (or `UPDATE … WHERE
version = …`) on the primary key (zone, key), then the pause switch, then the cap unit,
counted by upserts `… RETURNING` on one of the zone's slot rows (see _cap_args), and a
user's unit under its own caps (`smtpguard_reserve_user`); a refusal (paused, a cap
reached) is an error that rolls the whole statement back. A refund is one statement too
(`smtpguard_refund`). Every other record write is one compare-and-swap statement; queue
claims take rows with `FOR UPDATE SKIP LOCKED`. Every write is committed before the call
returns, as durable as the server's `synchronous_commit` makes it: with a synchronous
standby, a failover loses no write whose call returned.

PostgresStore (here) keeps the ledger and queue operations; the rest of the package: pool.py
(the pool, connection setup, each call's deadline, sampling the server's clock), controls.py,
desk.py, fleet.py (one class per role, inherited, as in store/sqlite/), rows.py (record rows,
their compare-and-swap and the cap units' arguments), and fencing.py, replication.py,
migrate.py, upgrade.py with migrations/.
"""

from __future__ import annotations

import json

import psycopg

from smtpguard.policy.ledger import Record
from smtpguard.policy.limits import WINDOW_KEEP, CapCheck, CapReached
from smtpguard.store.base import (
    Claimed,
    Conflict,
    QueuedMessage,
    Reserved,
    ReserveResult,
    entry_columns,
)
from smtpguard.store.errors import Probed
from smtpguard.store.postgres.controls import Controls
from smtpguard.store.postgres.desk import Desk
from smtpguard.store.postgres.fleet import Fleet
from smtpguard.store.postgres.migrate import MIGRATIONS
from smtpguard.store.postgres.pool import MIGRATE_WAIT as MIGRATE_WAIT
from smtpguard.store.postgres.pool import POOL_SIZE as POOL_SIZE
from smtpguard.store.postgres.pool import Pool, _translated
from smtpguard.store.postgres.replication import failover_problem
from smtpguard.store.postgres.rows import (
    _cap_args,
    _dump,
    _fetch,
    _ids,
    _load,
    _refusal,
    _swap,
    _user_args,
)
from smtpguard.store.sql.purge import ORPHANED_ENTRIES, aged_out, purgeable
from smtpguard.store.sql.statements import Plan

_PURGE_BATCH = 2000
_READ_ONLY_SQL = "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')"
"""/readyz's probe: a standby, or a session that may not write (fencing.py's read_only)."""

_MIGRATIONS = MIGRATIONS  # migrate.py runs them, once, at open

_RESERVE = "SELECT * FROM smtpguard_reserve(" + ", ".join(["%s"] * 20) + ")"
_RESERVE_USER = "SELECT * FROM smtpguard_reserve_user(" + ", ".join(["%s"] * 23) + ")"
_COUNT_UNIT = "SELECT smtpguard_count_unit(%s, %s, %s, %s, %s, %s, %s, %s, %s)"
_COUNT_UNITS = "SELECT smtpguard_count_units(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"


class PostgresStore(Probed, Controls, Desk, Fleet, Pool):
    @_translated
    async def durability_problems(self) -> list[str]:
        """Settings under which the server may forget a committed reservation (a duplicate
        send after a crash or a failover)."""
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('fsync', 'synchronous_commit', 'full_page_writes', 'synchronous_standby_names')"
            )
            got = {str(name): str(value) for name, value in await cur.fetchall()}
        problems = []
        if self._fence.multi_host:
            facts = await self._facts()
            self._replication.note(facts)
            problem = failover_problem(facts)
            if problem is not None:
                problems.append(problem)
        if got.get("fsync") != "on":
            problems.append(f"postgresql fsync is {got.get('fsync')!r}, not 'on': a crash forgets events")
        if got.get("full_page_writes") != "on":
            problems.append(
                f"postgresql full_page_writes is {got.get('full_page_writes')!r}, not 'on': "
                "a crash can corrupt the ledger"
            )
        sync = got.get("synchronous_commit")
        if sync == "off":
            problems.append(
                "postgresql synchronous_commit is 'off': a crash loses the last acknowledged writes"
            )
        elif sync == "local" and got.get("synchronous_standby_names"):
            problems.append(
                "postgresql synchronous_commit is 'local' while synchronous_standby_names is set: "
                "a failover loses the writes the standby had not received"
            )
        return problems

    @_translated
    async def _refusal(self) -> str | None:
        """Why the server would refuse a write (a standby, a role or database whose
        default_transaction_read_only is on), in the round trip a SELECT 1 took."""
        async with self._conn() as conn:
            row = await (await conn.execute(_READ_ONLY_SQL)).fetchone()
        assert row is not None
        if row[0]:
            return "postgresql: the server is a standby (pg_is_in_recovery)"
        if row[1] == "on":
            return "postgresql: transaction_read_only is on (default_transaction_read_only)"
        return None

    # --- ledger ------------------------------------------------------------------------------
    @_translated
    async def get(self, zone: str, key: str) -> Record | None:
        async with self._conn() as conn:
            return await _fetch(conn, zone, key)

    @_translated
    async def reserve(
        self, record: Record, expected_version: int | None, cap: CapCheck | None, paused: bool
    ) -> ReserveResult:
        data = _dump(record)
        mid, uid = _ids(record)
        user = _user_args(cap)
        try:
            # One statement, one round trip; with a user cap the user's unit is counted by
            # the same statement, so its refusal rolls the reservation and the zone's unit back.
            async with self._conn() as conn:
                cur = await conn.execute(
                    _RESERVE_USER if user else _RESERVE,
                    (
                        record.zone, record.key, expected_version, record.version, record.state.value,
                        record.updated_at, data, mid, uid, paused, cap is not None,
                        *_cap_args(cap, record.zone), *user,
                    ),
                )  # fmt: skip
                row = await cur.fetchone()
        except psycopg.Error as e:
            reached = _refusal(e, cap)
            if reached is None:
                raise
            return reached
        if row is None:
            return Conflict(None)
        if row[0]:
            return Reserved()
        if int(row[1]) == record.version and row[2] == data:
            return Reserved()  # our own write, its reply lost (DESIGN.md §11.4)
        return Conflict(_load(row[2]))

    @_translated
    async def put(self, record: Record, expected_version: int | None) -> Conflict | None:
        async with self._conn() as conn:
            swapped = await _swap(conn, record, expected_version)
        return swapped if isinstance(swapped, Conflict) else None

    @_translated
    async def refund(self, zone: str, token: str, month: str) -> None:
        # One statement (migration 6): the slot, the window row, the month and the user's
        # unit, in the lock order the counts and the purge use.
        async with self._conn() as conn:
            await conn.execute("SELECT smtpguard_refund(%s, %s, %s)", (zone, token, month))

    async def purge(self, now: float, retention: float) -> int:
        # Not one deadline for the whole purge: each step below has its own.
        deleted = await self._purge_events(now - retention, now)
        await self._purge_windows(now, retention)
        return deleted

    async def _purge_events(self, cutoff: float, now: float) -> int:
        # In batches, each its own transaction and deadline: a busy ledger's first expiry
        # outlasts any one statement's deadline.
        total = 0
        while (n := await self._purge_batch(cutoff, now)) > 0:
            total += n
        return total

    @_translated
    async def _purge_batch(self, cutoff: float, now: float) -> int:
        # The rule is shared (store/sql/purge.py); here it is taken _PURGE_BATCH rows at a time.
        where = purgeable(cutoff, now)
        batch = Plan(
            "DELETE FROM events WHERE ctid IN "
            f"(SELECT ctid FROM events WHERE {where.sql} LIMIT {_PURGE_BATCH})",
            where.params,
        )
        async with self._tx() as conn:
            cur = await conn.execute(*batch.postgres())
            n = cur.rowcount
            await conn.execute(*ORPHANED_ENTRIES.postgres())
        return int(n)

    @_translated
    async def _purge_windows(self, now: float, retention: float) -> None:
        async with self._tx() as conn:
            # Every slot row first: a count near its cap holds its zone's while it trims.
            await conn.execute("SELECT 1 FROM cap_slots ORDER BY zone, slot FOR UPDATE")
            await conn.execute(
                "WITH gone AS (DELETE FROM sends WHERE at < %s RETURNING zone, slot), "
                "per AS (SELECT zone, slot, count(*) AS c FROM gone GROUP BY zone, slot) "
                "UPDATE cap_slots s SET n = GREATEST(s.n - per.c, 0) FROM per "
                "WHERE s.zone = per.zone AND s.slot = per.slot",
                (now - WINDOW_KEEP,),
            )
            for plan in aged_out(now, retention):
                await conn.execute(*plan.postgres())

    @_translated
    async def consume_cap(self, cap: CapCheck) -> CapReached | None:
        user = _user_args(cap)
        try:
            async with self._conn() as conn:
                await conn.execute(_COUNT_UNITS if user else _COUNT_UNIT, (*_cap_args(cap, cap.zone), *user))
        except psycopg.Error as e:
            reached = _refusal(e, cap)
            if not isinstance(reached, CapReached):
                raise
            return reached
        return None

    # --- store-and-forward queue -------------------------------------------------------------
    @_translated
    async def enqueue(
        self, record: Record, expected_version: int | None, message: QueuedMessage
    ) -> Conflict | None:
        async with self._tx() as conn:
            swapped = await _swap(conn, record, expected_version)
            if isinstance(swapped, Conflict):
                return swapped
            await conn.execute(
                "INSERT INTO queue (zone, key, lane, priority, due_at, claimed_until, enqueued_at, "
                "sender, recipients, content, smtputf8) "
                "VALUES (%s, %s, %s, %s, %s, NULL, %s, %s, %s, %s, %s) "
                "ON CONFLICT (zone, key) DO UPDATE SET lane = excluded.lane, priority = excluded.priority, "
                "due_at = excluded.due_at, claimed_until = NULL, enqueued_at = excluded.enqueued_at, "
                "sender = excluded.sender, recipients = excluded.recipients, content = excluded.content, "
                "smtputf8 = excluded.smtputf8",
                (
                    record.zone,
                    record.key,
                    *entry_columns(record, message),
                    message.smtputf8,
                ),
            )
            return None

    @_translated
    async def claim(self, now: float, quotas: list[tuple[str, int]], lease: float) -> list[Claimed]:
        """One statement (smtpguard_claim): a worker polling an almost empty queue costs
        one round trip a poll."""
        if sum(max(n, 0) for _, n in quotas) <= 0:
            return []
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT * FROM smtpguard_claim(%s, %s::text[], %s::integer[], %s)",
                (now, [lane for lane, _ in quotas], [n for _, n in quotas], now + lease),
            )
            rows = sorted(await cur.fetchall(), key=lambda row: int(row[0]))
        return [
            Claimed(
                Record.from_dict(json.loads(data)),
                QueuedMessage(str(sender), tuple(json.loads(rcpts)), bytes(body), int(prio), bool(utf8)),
            )
            for _, _, _, sender, rcpts, body, prio, utf8, data in rows
        ]

    @_translated
    async def requeue(self, record: Record, expected_version: int, due: float | None) -> Conflict | None:
        async with self._tx() as conn:
            swapped = await _swap(conn, record, expected_version)
            if isinstance(swapped, Conflict):
                return swapped
            if due is None:
                await conn.execute(
                    "DELETE FROM queue WHERE zone = %s AND key = %s", (record.zone, record.key)
                )
            else:
                await conn.execute(
                    "UPDATE queue SET due_at = %s, claimed_until = NULL WHERE zone = %s AND key = %s",
                    (due, record.zone, record.key),
                )
            return None
