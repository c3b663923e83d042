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
counted by upserts `… RETURNING` on one of the zone's slot rows (see _cap_args); a refusal
(paused, a cap reached) is an error that rolls the whole statement back. Every other
record write is one compare-and-swap statement; queue claims take rows with `FOR UPDATE
SKIP LOCKED`. Every write is committed before the call returns, as durable as the server's
`synchronous_commit` makes it: with a synchronous standby, a failover loses no write whose
call returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from smtpguard.policy.events import bare_message_id
from smtpguard.policy.ledger import Record, State
from smtpguard.policy.limits import HOUR, CapCheck, CapReached
from smtpguard.policy.senders import suppression_key
from smtpguard.policy.throttle import gcra
from smtpguard.store.base import (
    HELD,
    CapUsage,
    CircuitState,
    Claimed,
    Conflict,
    IdField,
    Paused,
    ProbeState,
    QueuedMessage,
    QueueEntry,
    Reserved,
    ReserveResult,
    Slot,
    StoredEvent,
    StoreUnavailable,
    StoreUnfit,
    Suppression,
    ZoneAudit,
)
from smtpguard.store.clock import OnServerClock, ServerClock
from smtpguard.store.errors import translated
from smtpguard.store.postgres import fencing
from smtpguard.store.postgres.migrate import MIGRATIONS, SchemaBehind, migrate_on_own_connection
from smtpguard.store.postgres.replication import FACTS_SQL, Replication, ServerFacts, failover_problem
from smtpguard.store.sql import operations
from smtpguard.store.sql.statements import Result, Script

log = logging.getLogger("smtpguard.store")

Conn = AsyncConnection[tuple[Any, ...]]

T = TypeVar("T")
_TIMEOUT = 2.0
"""Deadline of one store operation, of taking a connection from the pool, and of a connect."""
POOL_SIZE = 32
"""Connections one process keeps at most (store.pool_size): each worker is a process."""
MIGRATE_WAIT = 5.0
"""Seconds `open` waits for the schema migration before serving 451 while it goes on."""
_WINDOW_KEEP = 2 * HOUR
_SLOTS = 16
"""Cap count slots per zone: how many of a zone's reservations may commit at once while its
caps are far (see _consume)."""
_SETTLED_EXCLUDED = (State.IN_FLIGHT.value, State.QUEUED.value)

_MIGRATIONS = MIGRATIONS  # migrate.py runs them, once, at open


def _connection_trouble(store: PostgresStore, e: Exception) -> None:
    if isinstance(e, psycopg.OperationalError | OSError):
        store._connection_trouble()


_translated = translated(
    psycopg.Error,
    PoolTimeout,
    OSError,
    backend="postgresql",
    timeout=lambda: _TIMEOUT,
    on_error=_connection_trouble,
)
"""The one place a driver error becomes StoreUnavailable (451 4.3.0, nothing relayed), and
where an operation gets its deadline (store/errors.py)."""


def _dump(r: Record) -> str:
    return json.dumps(r.to_dict(), separators=(",", ":"))


def _load(data: str | None) -> Record | None:
    return Record.from_dict(json.loads(data)) if data else None


def _ids(r: Record) -> tuple[str | None, str | None]:
    return (_text(bare_message_id(r.message_id)) if r.message_id else None, _text(r.upstream_id) or None)


def _text(value: str | None) -> str | None:
    """As PostgreSQL can store it: a reply decoded with surrogateescape (an upstream that
    answered in Latin-1) has lone surrogates, which UTF-8 cannot carry."""
    if value is None or value.isascii():
        return value
    return value.encode("utf-8", "replace").decode("utf-8").replace("\x00", "")


class PostgresStore(OnServerClock):
    def __init__(
        self,
        url: str,
        password: str | None = None,
        read_only: bool = False,
        create: bool = True,
        pool_size: int = POOL_SIZE,
    ) -> None:
        # read_only and create concern a store file; a PostgreSQL server has none to create.
        self.url = url
        self._password = password
        self._pool_size = pool_size
        self._kwargs: dict[str, Any] = {}
        self._fence = fencing.Fence(url, {})
        self._replication = Replication(self._fence.multi_host)
        self._watch_task: asyncio.Task[None] | None = None
        self._migrate_task: asyncio.Task[None] | None = None
        self._unfit: str | None = None
        self._waiting: str | None = None
        self._pool: AsyncConnectionPool[Conn] | None = None
        self._clock = ServerClock()
        self._clock_task: asyncio.Task[None] | None = None
        self._check_task: asyncio.Task[None] | None = None
        self._migrated = False

    # --- plumbing ----------------------------------------------------------------------------
    async def open(self) -> None:
        """Apply the schema migrations (migrate.py: no deadline) and build the pool.
        Connections are made on use, so an instance started while no read-write server
        answers starts anyway, answers 451, migrates and recovers once one does. A schema
        behind that this role may not upgrade is StoreUnfit, naming the role."""
        if self._pool is not None:
            return
        params = conninfo_to_dict(self.url)
        kwargs: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" not in params:
            kwargs["connect_timeout"] = int(_TIMEOUT)
        if self._password is not None:
            kwargs["password"] = self._password
        self._kwargs = kwargs
        self._fence = fencing.Fence(self.url, kwargs)
        first = asyncio.create_task(self._migrate_at_open())
        try:
            # Shielded: a migration has no deadline (a large index build, another instance
            # holding the lock, a commit waiting for a synchronous standby that is not
            # connected); past this wait it goes on and every call answers 451 meanwhile,
            # rather than `serve` neither listening nor saying why.
            migrated = await asyncio.wait_for(asyncio.shield(first), MIGRATE_WAIT)
        except TimeoutError:
            self._waiting = f"the schema migration has been running for more than {MIGRATE_WAIT:g} s"
            log.warning(
                "store schema migration still running; answering 451 until it ends (a large "
                "index build, another instance migrating, or a commit waiting for a "
                "synchronous standby that is not connected)"
            )
            self._migrate_task = asyncio.create_task(self._finish_migration(first))
        else:
            if not migrated:
                self._migrate_task = asyncio.create_task(self._migrate_later())
        pool: AsyncConnectionPool[Conn] = AsyncConnectionPool(
            self._fence.conninfo,
            min_size=1,
            max_size=self._pool_size,
            kwargs=kwargs,
            configure=self._configure,
            open=False,
            timeout=_TIMEOUT,
            # A failed connect is retried for this long, then given up; the next caller that
            # waits for a connection starts a new attempt at once. Without it the pool's
            # back-off (1, 2, 4, 8 s …) kept new sessions on 451 for seconds after a new
            # primary was up.
            reconnect_timeout=_TIMEOUT,
            name="smtpguard",
        )
        await pool.open(wait=False)
        self._pool = pool
        if self._migrated:
            with contextlib.suppress(StoreUnavailable):
                await self.sync_clock()
        self._clock_task = asyncio.create_task(self._clock.track(self.sync_clock))
        if self._fence.multi_host:
            self._watch_task = asyncio.create_task(self._watch())

    async def close(self) -> None:
        for task in (self._clock_task, self._check_task, self._watch_task, self._migrate_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._clock_task = self._check_task = self._watch_task = self._migrate_task = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close(timeout=1.0)

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[Conn]:
        if self._pool is None:
            raise StoreUnavailable("store is not open")
        if not self._migrated:
            raise StoreUnavailable(
                self._unfit or f"postgresql: schema not checked yet ({self._waiting or 'no server answered'})"
            )
        if self._fence.choice.refuse:
            # Known at once: waiting for the pool's timeout would only hold the session
            # (the watch asks the servers again every fencing.CHECK_EVERY).
            raise StoreUnavailable(f"postgresql: writing to no server: {self._fence.choice.reason}")
        async with self._pool.connection() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def _tx(self) -> AsyncIterator[Conn]:
        """A connection inside a transaction: committed on leaving, rolled back on any
        exception."""
        async with self._conn() as conn, conn.transaction():
            yield conn

    def _connection_trouble(self) -> None:
        """A connection failed: check the idle ones in the background, so the pool drops
        every connection to a server that is gone (a failover) rather than handing each to
        one more session."""
        self._fence.stale()
        if self._pool is None or (self._check_task is not None and not self._check_task.done()):
            return
        self._check_task = asyncio.create_task(self._pool.check())

    # --- schema, replication and fencing at connection setup (DESIGN.md §18) -----------------
    @property
    def synchronous(self) -> bool | None:
        """A synchronous standby streaming, as the last new connection or watch saw it
        (None: not known, this role may not read pg_stat_replication)."""
        return self._replication.synchronous

    async def _migrate_at_open(self) -> bool:
        """Migrate on a connection of its own, outside any call's deadline. False: no
        server answered (the caller retries in the background)."""
        try:
            conninfo = await self._fence.conninfo()
            done = await migrate_on_own_connection(conninfo, self._kwargs)
        except SchemaBehind as e:
            self._unfit = str(e)
            raise StoreUnfit(str(e)) from None
        except psycopg.OperationalError as e:
            self._waiting = str(e)  # fenced: no server to write to yet
            return False
        self._migrated = done is not None
        return self._migrated

    async def _finish_migration(self, first: asyncio.Task[bool]) -> None:
        try:
            done = await first
        except asyncio.CancelledError:
            first.cancel()
            raise
        except StoreUnfit as e:
            log.critical("store unusable: %s", e)
            return
        if not done:
            await self._migrate_later()
            return
        log.info("store schema migration done")
        with contextlib.suppress(StoreUnavailable):
            await self.sync_clock()

    async def _migrate_later(self) -> None:
        while not self._migrated:
            await asyncio.sleep(1.0)
            try:
                done = await self._migrate_at_open()
            except StoreUnfit as e:
                log.critical("store unusable: %s", e)
                return  # every call answers 451 naming the role (see _conn)
            if done:
                with contextlib.suppress(StoreUnavailable):
                    await self.sync_clock()

    async def _configure(self, conn: Conn) -> None:
        """Every new pooled connection: on the server fencing allows, and what its
        replication promises now (one query)."""
        row = await (await conn.execute(FACTS_SQL)).fetchone()
        assert row is not None
        facts = ServerFacts.of(row)
        self._fence.admit(facts)
        self._replication.note(facts)

    async def _watch(self) -> None:
        """Fencing and replication, every CHECK_EVERY while nothing else asks."""
        while True:
            await asyncio.sleep(fencing.CHECK_EVERY)
            with contextlib.suppress(psycopg.Error, OSError):
                if await self._fence.refresh() and self._pool is not None:
                    choice = self._fence.choice
                    if choice.refuse or choice.fenced:
                        # Connections made before may reach a server now fenced.
                        await self._pool.drain()
            with contextlib.suppress(StoreUnavailable):
                self._replication.note(await self._facts())

    @_translated
    async def _facts(self) -> ServerFacts:
        async with self._conn() as conn:
            row = await (await conn.execute(FACTS_SQL)).fetchone()
        assert row is not None
        return ServerFacts.of(row)

    # --- the store's clock (DESIGN.md §11.5) --------------------------------------------------
    @_translated
    async def sync_clock(self) -> None:
        async with self._conn() as conn:

            async def read() -> float:
                row = await (
                    await conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8")
                ).fetchone()
                assert row is not None
                return float(row[0])

            await self._clock.sample(read)

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

    async def ping(self) -> bool:
        try:
            return await self._ping()
        except StoreUnavailable:
            return False

    @_translated
    async def _ping(self) -> bool:
        async with self._conn() as conn:
            await conn.execute("SELECT 1")
        return True

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
            # With a user cap, the user's unit is a second statement of the same
            # transaction: its refusal rolls the reservation and the zone's unit back.
            async with self._tx() if user else self._conn() as conn:
                cur = await conn.execute(
                    "SELECT * FROM smtpguard_reserve(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
                    "%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    (
                        record.zone, record.key, expected_version, record.version, record.state.value,
                        record.updated_at, data, mid, uid, paused, cap is not None,
                        *_cap_args(cap, record.zone),
                    ),
                )  # fmt: skip
                row = await cur.fetchone()
                if user and row is not None and row[0]:
                    await conn.execute(_COUNT_USER_UNIT, user)
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
        async with self._tx() as conn:
            # The month the unit was counted in is kept with it; `month` is the caller's guess.
            # The slot's row is locked before its sends row: the order the counts and the
            # purge lock them in (the other order deadlocks against them).
            row = await _one(conn, "SELECT slot FROM sends WHERE zone = %s AND token = %s", (zone, token))
            if row is None:
                return
            await conn.execute(
                "SELECT 1 FROM cap_slots WHERE zone = %s AND slot = %s FOR UPDATE", (zone, row[0])
            )
            gone = await _one(
                conn, "DELETE FROM sends WHERE zone = %s AND token = %s RETURNING month, slot", (zone, token)
            )
            if gone is not None:
                await conn.execute(
                    "UPDATE cap_slots SET n = GREATEST(n - 1, 0) WHERE zone = %s AND slot = %s",
                    (zone, gone[1]),
                )
                await conn.execute(
                    "UPDATE monthly SET used = GREATEST(used - 1, 0) "
                    "WHERE zone = %s AND month = %s AND slot = %s",
                    (zone, gone[0] or month, gone[1]),
                )
            # The user's unit counted with the token, if any (DESIGN.md §16).
            held = await _one(
                conn,
                "DELETE FROM user_sends WHERE zone = %s AND token = %s RETURNING username, month",
                (zone, token),
            )
            if held is not None:
                await conn.execute(
                    "UPDATE user_monthly SET used = GREATEST(used - 1, 0) "
                    "WHERE zone = %s AND username = %s AND month = %s",
                    (zone, held[0], held[1]),
                )

    async def purge(self, now: float, retention: float) -> int:
        # Not one deadline for the whole purge: each step below has its own.
        deleted = await self._purge_events(now - retention)
        await self._purge_windows(now, retention)
        return deleted

    async def _purge_events(self, cutoff: float) -> int:
        # In batches, each its own transaction and deadline: a busy ledger's first expiry
        # outlasts any one statement's deadline.
        total = 0
        while (n := await self._purge_batch(cutoff)) > 0:
            total += n
        return total

    @_translated
    async def _purge_batch(self, cutoff: float) -> int:
        async with self._tx() as conn:
            cur = await conn.execute(
                "DELETE FROM events WHERE ctid IN (SELECT ctid FROM events WHERE updated_at < %s "
                "AND state <> ALL(%s) LIMIT 2000)",
                (cutoff, list(_SETTLED_EXCLUDED)),
            )
            n = cur.rowcount
            # Store-and-forward entries kept for an operator (unknown, failed) go with their record.
            await conn.execute(
                "DELETE FROM queue q WHERE NOT EXISTS "
                "(SELECT 1 FROM events e WHERE e.zone = q.zone AND e.key = q.key)"
            )
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
                (now - _WINDOW_KEEP,),
            )
            await conn.execute("DELETE FROM auth_failures WHERE at < %s", (now - _WINDOW_KEEP,))
            await conn.execute("DELETE FROM user_sends WHERE at < %s", (now - _WINDOW_KEEP,))
            await conn.execute("DELETE FROM provider_events WHERE received_at < %s", (now - retention,))
            await conn.execute("DELETE FROM nonces WHERE until < %s", (now,))
            await conn.execute("DELETE FROM zone_audit WHERE at < %s", (now - retention,))

    @_translated
    async def consume_cap(self, cap: CapCheck) -> CapReached | None:
        user = _user_args(cap)
        try:
            async with self._tx() if user else self._conn() as conn:
                await conn.execute(
                    "SELECT smtpguard_count_unit(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    _cap_args(cap, cap.zone),
                )
                if user:
                    await conn.execute(_COUNT_USER_UNIT, user)
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
                    record.lane or "",
                    message.priority,
                    record.next_attempt_at if record.next_attempt_at is not None else record.updated_at,
                    record.updated_at,
                    message.sender,
                    json.dumps(list(message.recipients)),
                    message.content,
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

    @_translated
    async def queue_entries(self, zone: str | None) -> list[QueueEntry]:
        async with self._conn() as conn:
            cur = await conn.execute(
                "SELECT q.zone, q.key, q.lane, e.state, q.due_at, q.claimed_until, q.enqueued_at, "
                "length(q.content) FROM queue q LEFT JOIN events e ON e.zone = q.zone AND e.key = q.key "
                "WHERE (%s::text IS NULL OR q.zone = %s) ORDER BY q.priority, q.due_at, q.zone, q.key",
                (zone, zone),
            )
            rows = await cur.fetchall()
        now = self.now()
        return [
            QueueEntry(
                str(z),
                str(k),
                str(lane),
                str(state) if state else "?",
                None if due >= HELD else float(due),
                claimed is not None and claimed > now,
                float(enq),
                int(size),
            )
            for z, k, lane, state, due, claimed, enq, size in rows
        ]

    @_translated
    async def queue_lanes(self) -> set[str]:
        async with self._conn() as conn:
            cur = await conn.execute("SELECT DISTINCT lane FROM queue")
            return {str(lane) for (lane,) in await cur.fetchall()}

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
            added = await _one(
                conn,
                "INSERT INTO provider_events (zone, source, event_id, key, received_at, data) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1",
                (
                    zone,
                    event.source,
                    event.id,
                    key,
                    event.received_at,
                    json.dumps(event.to_dict(), separators=(",", ":")),
                ),
            )
            if added is None:
                return False
            if suppress_reason is not None and event.recipient is not None:
                await _list(conn, zone, suppression_key(event.recipient), suppress_reason, event.received_at)
            return True

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
            await conn.execute(
                "INSERT INTO zone_audit (zone, at, actor, action, key, note) VALUES (%s, %s, %s, %s, %s, %s)",
                (zone, entry.at, entry.actor, entry.action, entry.key, entry.note),
            )

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
            cur = await conn.execute("SELECT zone, lane, count(*) FROM queue GROUP BY zone, lane")
            return {(str(z), str(lane)): int(n) for z, lane, n in await cur.fetchall()}

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


# --- statements shared by the operations --------------------------------------------------------
async def _one(conn: Conn, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    cur = await conn.execute(sql, params)
    return await cur.fetchone()


async def _run_script(conn: Conn, script: Script[T]) -> T:
    """A shared operation of several statements (store/sql/), in the caller's transaction."""
    result: Result | None = None
    while True:
        try:
            step = next(script) if result is None else script.send(result)
        except StopIteration as done:
            answer: T = done.value
            return answer
        cur = await conn.execute(*step.postgres())
        rows = await cur.fetchall() if cur.description is not None else []
        result = Result(rows, cur.rowcount)


async def _fetch(conn: Conn, zone: str, key: str) -> Record | None:
    row = await _one(conn, "SELECT data FROM events WHERE zone = %s AND key = %s", (zone, key))
    return _load(row[0]) if row else None


class _Own:
    pass


_OWN = _Own()
"""_swap's answer when the record already equals the one being written: a retried write
whose first run landed (DESIGN.md §11.4)."""


async def _swap(conn: Conn, r: Record, expected_version: int | None) -> Conflict | _Own | bool:
    """Write `r` over exactly `expected_version` (None: only if absent) in one statement;
    the current record is read only when that fails. A bool: written, and whether the zone
    is paused (read by the same statement, for reserve); _OWN: it was already there, byte
    for byte; else the Conflict with the current record."""
    data = _dump(r)
    mid, uid = _ids(r)
    if expected_version is None:
        written = await _one(
            conn,
            "INSERT INTO events (zone, key, version, state, updated_at, data, mid, uid) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (zone, key) DO NOTHING "
            "RETURNING EXISTS (SELECT 1 FROM paused p WHERE p.zone = events.zone)",
            (r.zone, r.key, r.version, r.state.value, r.updated_at, data, mid, uid),
        )
    else:
        written = await _one(
            conn,
            "UPDATE events SET version = %s, state = %s, updated_at = %s, data = %s, mid = %s, uid = %s "
            "WHERE zone = %s AND key = %s AND version = %s "
            "RETURNING EXISTS (SELECT 1 FROM paused p WHERE p.zone = events.zone)",
            (r.version, r.state.value, r.updated_at, data, mid, uid, r.zone, r.key, expected_version),
        )
    if written is not None:
        return bool(written[0])
    row = await _one(conn, "SELECT version, data FROM events WHERE zone = %s AND key = %s", (r.zone, r.key))
    if row is None:
        return Conflict(None)
    if int(row[0]) == r.version and row[1] == data:
        return _OWN
    return Conflict(_load(row[1]))


def _cap_args(cap: CapCheck | None, zone: str) -> tuple[Any, ...]:
    """smtpguard_count_unit's arguments (see the migration). A zone's count is spread over
    _SLOTS slots: one cap counter row, locked until COMMIT (and COMMIT waits for the WAL
    flush, and for a synchronous standby), would let one reservation of the zone commit at
    a time. A unit locks one slot and reads the zone's totals: counts of other slots not yet
    committed are invisible, but each holds its slot's lock, so at most _SLOTS - 1 are
    missing; the hour is bounded from above by the window rows each slot keeps (nothing is
    scanned). Within that margin of both caps the unit is counted at once; nearer, it takes
    every slot of the zone in order and counts exactly. No cap is ever exceeded."""
    if cap is None:
        return (zone, "", 0.0, "", 0, 0.0, 0, 0, _SLOTS)
    return (
        cap.zone, cap.token, cap.now, cap.month, secrets.randbelow(_SLOTS), cap.hour_start,
        cap.caps.hourly, cap.caps.monthly, _SLOTS,
    )  # fmt: skip


_COUNT_USER_UNIT = "SELECT smtpguard_count_user_unit(%s, %s, %s, %s, %s, %s, %s, %s)"


def _user_args(cap: CapCheck | None) -> tuple[Any, ...]:
    """smtpguard_count_user_unit's arguments; empty when the unit has no user cap."""
    if cap is None or cap.user is None or cap.user_caps is None:
        return ()
    return (
        cap.zone, cap.user, cap.token, cap.now, cap.month, cap.hour_start,
        cap.user_caps.hourly, cap.user_caps.monthly,
    )  # fmt: skip


def _refusal(e: psycopg.Error, cap: CapCheck | None) -> ReserveResult | None:
    """What an error raised by the reservation's functions answers, if it is a refusal."""
    if e.sqlstate == "SGP01":
        return Paused()
    if cap is None:
        return None
    if cap.user is not None and cap.user_caps is not None:
        if e.sqlstate == "SGV01":
            return CapReached("month", cap.user_caps.monthly, user=cap.user)
        if e.sqlstate == "SGU01":
            free = float(e.diag.message_primary or cap.now) + HOUR
            return CapReached("hour", cap.user_caps.hourly, free, user=cap.user)
    if e.sqlstate == "SGM01":
        return CapReached("month", cap.caps.monthly)
    if e.sqlstate == "SGH01":
        return CapReached("hour", cap.caps.hourly, float(e.diag.message_primary or cap.now) + HOUR)
    return None


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
