"""The pool and connection setup every role of the PostgreSQL store goes through: the
deadline and error translation of each call (store/errors.py), schema migration at open,
fencing and replication on each new connection, and sampling the server's clock
(store/clock.py; DESIGN.md §11.5, §15, §18)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, ParamSpec, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from smtpguard.store.base import StoreUnavailable, StoreUnfit
from smtpguard.store.clock import OnServerClock, ServerClock
from smtpguard.store.errors import translated
from smtpguard.store.postgres import fencing
from smtpguard.store.postgres.migrate import SchemaBehind, migrate_on_own_connection
from smtpguard.store.postgres.replication import FACTS_SQL, Replication, ServerFacts
from smtpguard.store.sql.roles import Runner
from smtpguard.store.sql.statements import Done, Plan, Result, Script, advance

log = logging.getLogger("smtpguard.store")

Conn = AsyncConnection[tuple[Any, ...]]

T = TypeVar("T")
P = ParamSpec("P")
_TIMEOUT = 2.0
"""Deadline of one store operation, of taking a connection from the pool, and of a connect."""
POOL_SIZE = 32
"""Connections one process keeps at most (store.pool_size): each worker is a process."""
MIGRATE_WAIT = 5.0
"""Seconds `open` waits for the schema migration before serving 451 while it goes on."""


def _connection_trouble(store: Pool, e: Exception) -> None:
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


class Pool(OnServerClock, Runner):
    """The connections every role's operations go through (inherited by PostgresStore)."""

    def __init__(
        self,
        url: str,
        password: str | None = None,
        pool_size: int = POOL_SIZE,
    ) -> None:
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

    # --- the shared roles' runner (store/sql/roles.py) ----------------------------------------
    @_translated
    async def _rows(self, plan: Plan) -> list[tuple[Any, ...]]:
        async with self._conn() as conn:
            cur = await conn.execute(*plan.postgres())
            return await cur.fetchall()

    @_translated
    async def _execute(self, plan: Plan) -> None:
        async with self._conn() as conn:
            await conn.execute(*plan.postgres())

    @_translated
    async def _script(self, make: Callable[P, Script[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        async with self._tx() as conn:
            return await _run_script(conn, make(*args, **kwargs))

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


# --- statements shared by the operations --------------------------------------------------------
async def _one(conn: Conn, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    cur = await conn.execute(sql, params)
    return await cur.fetchone()


async def _run_script(conn: Conn, script: Script[T]) -> T:
    """A shared operation of several statements (store/sql/), in the caller's transaction."""
    step = advance(script, None)
    while not isinstance(step, Done):
        cur = await conn.execute(*step.postgres())
        rows = await cur.fetchall() if cur.description is not None else []
        step = advance(script, Result(rows, cur.rowcount))
    return step.value
