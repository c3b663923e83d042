"""SQLite backend: the embedded default, one process, no server.

Writes go through one writer thread that groups every write waiting at that moment into a
single transaction and a single fsync (group commit). Durability is not relaxed: WAL with
synchronous=FULL, and no coroutine learns its write succeeded before COMMIT returned. Under
load, fifty concurrent reservations cost one fsync instead of fifty. Reads use their own
connections in a small thread pool, so the event loop never blocks on SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from smtpguard.policy.ledger import Record, State
from smtpguard.policy.limits import HOUR, CapCheck, CapReached, Caps
from smtpguard.policy.senders import suppression_key
from smtpguard.policy.throttle import Slot, gcra
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
    StoredEvent,
    StoreMissing,
    StoreUnavailable,
    Suppression,
    ZoneAudit,
    id_forms,
)

T = TypeVar("T")
log = logging.getLogger("smtpguard.store")
_MAX_BATCH = 512
_HEAVY_BODY = 64 * 1024
"""A queued message body at least this large is written on the writer thread (its pages
spill to the WAL), not on the event loop's."""
_MIN_SQLITE = (3, 35, 0)
"""RETURNING (the optimistic cap counts) needs SQLite 3.35."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    zone TEXT NOT NULL, key TEXT NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL,
    updated_at REAL NOT NULL, data TEXT NOT NULL, PRIMARY KEY (zone, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_updated ON events (updated_at);
CREATE TABLE IF NOT EXISTS sends (
    zone TEXT NOT NULL, token TEXT NOT NULL, at REAL NOT NULL, month TEXT NOT NULL,
    PRIMARY KEY (zone, token)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS sends_zone_at ON sends (zone, at);
CREATE TABLE IF NOT EXISTS send_counts (zone TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS monthly (
    zone TEXT NOT NULL, month TEXT NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (zone, month)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS paused (zone TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS suppression (
    zone TEXT NOT NULL, address TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (zone, address)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS supp_versions (zone TEXT PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS auth_failures (ip TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS auth_failures_ip_at ON auth_failures (ip, at);
CREATE TABLE IF NOT EXISTS queue (
    zone TEXT NOT NULL, key TEXT NOT NULL, lane TEXT NOT NULL, priority INTEGER NOT NULL,
    due_at REAL NOT NULL, claimed_until REAL, enqueued_at REAL NOT NULL, sender TEXT NOT NULL,
    recipients TEXT NOT NULL, content BLOB NOT NULL, smtputf8 INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (zone, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS queue_lane_due ON queue (lane, due_at);
CREATE TABLE IF NOT EXISTS circuits (
    instance TEXT NOT NULL, provider TEXT NOT NULL, circuit TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (instance, provider)) WITHOUT ROWID;
-- Provider events (DESIGN.md §13): one row per event applied; the key makes an event
-- applied once, and the rows of a record are its `events` history.
CREATE TABLE IF NOT EXISTS provider_events (
    zone TEXT NOT NULL, source TEXT NOT NULL, event_id TEXT NOT NULL, key TEXT NOT NULL,
    received_at REAL NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (zone, source, event_id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS provider_events_of_record ON provider_events (zone, key, received_at);
CREATE INDEX IF NOT EXISTS provider_events_received ON provider_events (received_at);
-- A provider event names its message by Message-ID or by the id in the provider's 250.
CREATE INDEX IF NOT EXISTS events_message_id ON events (json_extract(data, '$.message_id'));
CREATE INDEX IF NOT EXISTS events_upstream_id ON events (json_extract(data, '$.upstream_id'));
CREATE INDEX IF NOT EXISTS events_sg_id ON events (json_extract(data, '$.sg_id'));
-- The operator's lists (DESIGN.md §14): a zone's records by state, newest first.
CREATE INDEX IF NOT EXISTS events_zone_state ON events (zone, state, updated_at);
CREATE INDEX IF NOT EXISTS events_zone_updated ON events (zone, updated_at);
-- Zone-level operator actions (pause, resume, suppress, queue drop, decisions).
CREATE TABLE IF NOT EXISTS zone_audit (
    zone TEXT NOT NULL, at REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
    key TEXT NOT NULL, note TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS zone_audit_zone_at ON zone_audit (zone, at);
CREATE TABLE IF NOT EXISTS probes (
    instance TEXT NOT NULL, provider TEXT NOT NULL, ready INTEGER NOT NULL, detail TEXT NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (instance, provider)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS nonces (
    name TEXT PRIMARY KEY, digest TEXT NOT NULL, until REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (
    zone TEXT NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL,
    PRIMARY KEY (zone, name)) WITHOUT ROWID;
-- Provider throttling (DESIGN.md §16): each provider's next send slot (GCRA), its
-- throttle after a rate-limit reply, and the leased slots of its open connections.
CREATE TABLE IF NOT EXISTS rate_slots (provider TEXT PRIMARY KEY, tat REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS throttles (provider TEXT PRIMARY KEY, until REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS connection_slots (
    provider TEXT NOT NULL, holder TEXT NOT NULL, until REAL NOT NULL,
    PRIMARY KEY (provider, holder)) WITHOUT ROWID;
-- Stream controls (DESIGN.md §16): one message class of a zone paused; each SMTP user's
-- own cap units, kept by token as the zone's are (a refund names the token alone).
CREATE TABLE IF NOT EXISTS paused_classes (
    zone TEXT NOT NULL, class TEXT NOT NULL, PRIMARY KEY (zone, class)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS user_sends (
    zone TEXT NOT NULL, token TEXT NOT NULL, username TEXT NOT NULL, at REAL NOT NULL,
    month TEXT NOT NULL, PRIMARY KEY (zone, token)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS user_sends_user_at ON user_sends (zone, username, at);
CREATE TABLE IF NOT EXISTS user_monthly (
    zone TEXT NOT NULL, username TEXT NOT NULL, month TEXT NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (zone, username, month)) WITHOUT ROWID;
"""


_STATE_COUNTS = (
    "CREATE TABLE state_counts (zone TEXT NOT NULL, state TEXT NOT NULL, n INTEGER NOT NULL, "
    "PRIMARY KEY (zone, state)) WITHOUT ROWID",
    "CREATE TRIGGER events_count_insert AFTER INSERT ON events BEGIN "
    "INSERT INTO state_counts (zone, state, n) VALUES (new.zone, new.state, 1) "
    "ON CONFLICT (zone, state) DO UPDATE SET n = n + 1; END",
    "CREATE TRIGGER events_count_update AFTER UPDATE OF state ON events WHEN old.state != new.state BEGIN "
    "UPDATE state_counts SET n = n - 1 WHERE zone = old.zone AND state = old.state; "
    "INSERT INTO state_counts (zone, state, n) VALUES (new.zone, new.state, 1) "
    "ON CONFLICT (zone, state) DO UPDATE SET n = n + 1; END",
    "CREATE TRIGGER events_count_delete AFTER DELETE ON events BEGIN "
    "UPDATE state_counts SET n = n - 1 WHERE zone = old.zone AND state = old.state; END",
    "INSERT INTO state_counts (zone, state, n) SELECT zone, state, COUNT(*) FROM events GROUP BY zone, state",
)


def _count_states(conn: sqlite3.Connection) -> None:
    """Records per zone and state, kept by triggers in the writing transaction: counting
    the state index of a million records takes a quarter of a second, and the console's
    zones page and the smtpguard_ledger_records gauge ask often. Created once, with the
    counts of the records already there, in one transaction (another process may be
    writing)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'state_counts'"
        ).fetchone()
        if exists is None:
            for statement in _STATE_COUNTS:
                conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def path_from_url(url: str) -> Path:
    """`sqlite:///var/x.db` is relative to the working directory, `sqlite:////x.db` absolute."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url}")
    return Path(url[len("sqlite:///") :])


_CREATE = re.compile(r"CREATE (TABLE|INDEX) IF NOT EXISTS (\w+)(?: ON (\w+))?")


def _stand_in_for_missing_tables(conn: sqlite3.Connection) -> None:
    """A store written by an older version lacks the newer tables until `serve` opens it for
    writing (CREATE IF NOT EXISTS). A read-only opener (the CLI) cannot create them there, so
    it creates empty TEMP tables of the same names on its own connection: each read of one
    finds nothing, rather than failing with "no such table"."""
    present = {str(name) for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    temp: set[str] = set()
    schema = "\n".join(line for line in _SCHEMA.splitlines() if not line.startswith("--"))
    for statement in schema.split(";"):
        sql = statement.strip()
        m = _CREATE.match(sql)
        if m is None or m.group(2) in present:
            continue
        kind, name, table = m.groups()
        if kind == "TABLE":
            conn.execute(sql.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))
            temp.add(name)
        elif table in temp:
            conn.execute(sql.replace(f"EXISTS {name}", f"EXISTS temp.{name}", 1))


def _index_names(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' "
        "UNION SELECT name FROM sqlite_temp_master WHERE type = 'index'"
    )
    return {str(name) for (name,) in rows}


def _connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        # mode=ro: a reader never creates the file, whatever the working directory.
        uri = f"file:{quote(str(path.absolute()))}?mode=ro"
        conn = sqlite3.connect(uri, isolation_level=None, check_same_thread=False, timeout=30, uri=True)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    if readonly:
        _stand_in_for_missing_tables(conn)
        conn.execute("PRAGMA query_only = ON")
    else:
        conn.execute("PRAGMA journal_mode = WAL")
        # FULL: a commit is on disk before the writer reports it (the 250 depends on it).
        conn.execute("PRAGMA synchronous = FULL")
    return conn


_Op = Callable[[sqlite3.Connection], Any]
_Result = tuple["asyncio.Future[Any]", Any, BaseException | None]
_BUSY_RETRY_FOR = 30.0
"""Seconds a write waits for the database lock held by another process (the CLI)."""


class _Writer:
    """Runs write operations in batches: one BEGIN IMMEDIATE … COMMIT per batch.

    The statements of a batch run on the event loop's thread, and only COMMIT (the fsync)
    runs on the writer thread. Run on a thread of their own, each statement gave the GIL
    back to the busy event loop and waited for it again: under load a batch spent about
    three times its CPU time waiting, and every write of a message waited for that.
    Operations that may take long (the purge, claims, queued bodies of 64 KB or more) are
    marked `heavy` and run, with their batch, on the writer thread, so the event loop never
    waits on them."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smtpguard-sqlite-writer")
        self._conn: sqlite3.Connection | None = None
        self._pending: list[tuple[_Op, asyncio.Future[Any], bool]] = []
        self._flushing: asyncio.Task[None] | None = None

    async def open(self) -> None:
        def connect() -> sqlite3.Connection:
            conn = _connect(self._path)
            conn.executescript(_SCHEMA)
            _count_states(conn)
            columns = {row[1] for row in conn.execute("PRAGMA table_info(queue)")}
            if "smtputf8" not in columns:  # a file from before queued mail kept the flag
                try:
                    conn.execute("ALTER TABLE queue ADD COLUMN smtputf8 INTEGER NOT NULL DEFAULT 0")
                except sqlite3.OperationalError as e:
                    # Another process opening the same file (workers, the CLI) added it first.
                    if "duplicate column" not in str(e):
                        raise
            # The loop thread must never wait on a lock held by another process: a busy
            # BEGIN is retried on the writer thread instead (_begin_waiting).
            conn.execute("PRAGMA busy_timeout = 0")
            return conn

        self._conn = await asyncio.get_running_loop().run_in_executor(self._thread, connect)

    async def close(self) -> None:
        while self._flushing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._flushing)
        conn, self._conn = self._conn, None
        if conn is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, conn.close)
        self._thread.shutdown(wait=True)

    def submit(self, fn: Callable[[sqlite3.Connection], T], heavy: bool = False) -> asyncio.Future[T]:
        if self._conn is None:
            raise StoreUnavailable("store is not open")
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((fn, fut, heavy))
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())
        return fut

    async def _flush(self) -> None:
        """Run batches until nothing is pending. Every future taken into a batch is settled,
        whatever happens to the batch; writes still pending if the flush itself is
        cancelled (event loop teardown) fail rather than wait for a flush that never comes."""
        try:
            # Yield once, so every write submitted in this turn of the loop joins the batch.
            await asyncio.sleep(0)
            while self._pending:
                batch, self._pending = self._pending[:_MAX_BATCH], self._pending[_MAX_BATCH:]
                ops = [(fn, fut) for fn, fut, _ in batch]
                try:
                    if any(heavy for _, _, heavy in batch):
                        loop = asyncio.get_running_loop()
                        results = await loop.run_in_executor(self._thread, self._run_batch_blocking, ops)
                    else:
                        results = await self._run_batch(ops)
                except BaseException as e:
                    # Cancelled while COMMIT ran (it may still complete) or a bug: the
                    # callers hear "unavailable", the lease and the ledger sort out the rest.
                    _settle_all(_failed(ops, e))
                    raise
                _settle_all(results)
        except BaseException as e:
            pending, self._pending = self._pending, []
            _settle_all(_failed([(fn, fut) for fn, fut, _ in pending], e))
            if not isinstance(e, asyncio.CancelledError):
                log.error("sqlite writer failed", extra={"error": repr(e)})
            raise
        finally:
            self._flushing = None

    async def _run_batch(self, batch: list[tuple[_Op, asyncio.Future[Any]]]) -> list[_Result]:
        conn = self._conn
        assert conn is not None
        loop = asyncio.get_running_loop()
        try:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:
                await loop.run_in_executor(self._thread, _begin_waiting, conn)
        except Exception as e:
            return _failed(batch, e)
        results = _apply(conn, batch)
        if results is None:
            return await loop.run_in_executor(self._thread, _run_each_alone, conn, batch)
        try:
            await loop.run_in_executor(self._thread, conn.execute, "COMMIT")
        except Exception as e:
            _rollback(conn)
            return _failed(batch, e)
        return results

    def _run_batch_blocking(self, batch: list[tuple[_Op, asyncio.Future[Any]]]) -> list[_Result]:
        """The same batch, all of it on the writer thread (a batch with a heavy operation)."""
        conn = self._conn
        assert conn is not None
        try:
            _begin_waiting(conn)
        except Exception as e:
            return _failed(batch, e)
        results = _apply(conn, batch)
        if results is None:
            return _run_each_alone(conn, batch)
        try:
            conn.execute("COMMIT")
        except Exception as e:
            _rollback(conn)
            return _failed(batch, e)
        return results


def _apply(conn: sqlite3.Connection, batch: list[tuple[_Op, asyncio.Future[Any]]]) -> list[_Result] | None:
    """Every operation of the batch in the open transaction; None (rolled back) if one
    failed, so that each can be run in a transaction of its own and only the failing one
    reports it."""
    try:
        return [(fut, fn(conn), None) for fn, fut in batch]
    except Exception:
        _rollback(conn)
        return None


def _rollback(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        conn.execute("ROLLBACK")


def _failed(batch: list[tuple[_Op, asyncio.Future[Any]]], error: BaseException) -> list[_Result]:
    """BEGIN or COMMIT failed (lock held elsewhere, disk full, I/O): the whole batch fails at
    once, rather than each write waiting out the lock again on its own."""
    failure = StoreUnavailable(f"sqlite transaction failed: {error}")
    return [(fut, None, failure) for _, fut in batch]


def _begin_waiting(conn: sqlite3.Connection) -> None:
    """BEGIN IMMEDIATE, waiting (on the writer thread) for another process's lock."""
    deadline = time.monotonic() + _BUSY_RETRY_FOR
    delay = 0.001
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as e:
            if ("locked" not in str(e) and "busy" not in str(e)) or time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _run_each_alone(conn: sqlite3.Connection, batch: list[tuple[_Op, asyncio.Future[Any]]]) -> list[_Result]:
    results: list[_Result] = []
    for fn, fut in batch:
        try:
            _begin_waiting(conn)
            value = fn(conn)
            conn.execute("COMMIT")
        except Exception as e:
            _rollback(conn)
            # Callers know one failure: the store could not do it (disk full, I/O).
            failed: Exception = StoreUnavailable(f"sqlite: {e}") if isinstance(e, sqlite3.Error) else e
            results.append((fut, None, failed))
        else:
            results.append((fut, value, None))
    return results


def _settle_all(items: list[_Result]) -> None:
    for fut, value, error in items:
        if fut.done():
            continue
        if error is None:
            fut.set_result(value)
        elif isinstance(error, Exception) and not isinstance(error, StopIteration):
            fut.set_exception(error)
        else:
            # What a future refuses to carry (StopIteration, a cancellation): still an answer.
            fut.set_exception(StoreUnavailable(f"sqlite write failed: {error!r}"))


class SQLiteStore:
    def __init__(
        self, url: str, password: str | None = None, read_only: bool = False, create: bool = True
    ) -> None:
        self.path = path_from_url(url)
        self.read_only = read_only
        """Readers only, each opened with mode=ro: writes raise StoreUnavailable."""
        self.create = create and not read_only
        self._opened = False
        self._writer: _Writer | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._local = threading.local()

    # --- plumbing ----------------------------------------------------------------------------
    async def open(self) -> None:
        if self._writer is not None or self._opened:
            return
        if not self.create and not self.path.is_file():
            where = self.path if self.path.is_absolute() else f"{self.path} (in {Path.cwd()})"
            raise StoreMissing(
                f"store {where} does not exist; check store.url in the config and the working "
                "directory (smtpguard serve creates it)"
            )
        if self.read_only:
            self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="smtpguard-sqlite-read")
            self._opened = True
            return
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            need = ".".join(map(str, _MIN_SQLITE))
            raise StoreUnavailable(
                f"SQLite {sqlite3.sqlite_version} is too old: smtpguard needs {need} or newer "
                "(Python's sqlite3 module is linked against it; use Redis or a newer Python build)"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        writer = _Writer(self.path)
        try:
            await writer.open()
        except Exception as e:
            await writer.close()
            raise StoreUnavailable(f"cannot open {self.path}: {e}") from e
        self._writer = writer
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="smtpguard-sqlite-read")
        await self._write(_fold_suppression_keys, heavy=True)

    async def close(self) -> None:
        self._opened = False
        if self._writer is not None:
            writer, self._writer = self._writer, None
            await writer.close()
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None

    def now(self) -> float:
        # One machine, one clock: every process sharing the file reads the same one.
        return time.time()

    async def durability_problems(self) -> list[str]:
        return []  # synchronous=FULL in WAL, set at every connect

    async def queue_lanes(self) -> set[str]:
        def op(c: sqlite3.Connection) -> set[str]:
            return {str(lane) for (lane,) in c.execute("SELECT DISTINCT lane FROM queue")}

        return await self._read(op)

    async def ping(self) -> bool:
        try:
            await self._read(lambda c: c.execute("SELECT 1").fetchone())
        except Exception:
            return False
        return True

    def _write(self, fn: Callable[[sqlite3.Connection], T], heavy: bool = False) -> asyncio.Future[T]:
        if self._writer is None:
            raise StoreUnavailable("store is opened read-only" if self.read_only else "store is not open")
        return self._writer.submit(fn, heavy)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._readers is None:
            raise StoreUnavailable("store is not open")

        def run() -> T:
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = _connect(self.path, readonly=True)
                self._local.indexes = _index_names(conn)
                self._local.conn = conn
            return fn(conn)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._readers, run)
        except sqlite3.Error as e:
            raise StoreUnavailable(f"sqlite read failed: {e}") from e

    def _table(self, table: str, index: str) -> str:
        """`table INDEXED BY index`, or just `table` where the index is not there (a store
        of an older version, read before `serve` has upgraded it). On a reader thread only."""
        indexes: set[str] = getattr(self._local, "indexes", set())
        return f"{table} INDEXED BY {index}" if index in indexes else table

    # --- ledger ------------------------------------------------------------------------------
    async def get(self, zone: str, key: str) -> Record | None:
        def op(c: sqlite3.Connection) -> Record | None:
            return _load(c, zone, key)

        return await self._read(op)

    async def reserve(
        self, record: Record, expected_version: int | None, cap: CapCheck | None, paused: bool
    ) -> ReserveResult:
        def op(c: sqlite3.Connection) -> ReserveResult:
            if expected_version is None:
                # A new key, the common case: claim it first (a duplicate is caught here, even
                # when the zone is paused or capped) and give it back if pause or caps refuse.
                swapped = _swap(c, record, None)
                if isinstance(swapped, Conflict):
                    return swapped
                if swapped == _OWN:
                    return Reserved()
                refused = _pause_or_cap(c, record.zone, paused, cap)
                if refused is not None:
                    c.execute("DELETE FROM events WHERE zone = ? AND key = ?", (record.zone, record.key))
                return refused or Reserved()
            row = c.execute(
                "SELECT version FROM events WHERE zone = ? AND key = ?", (record.zone, record.key)
            ).fetchone()
            if (row[0] if row else None) != expected_version:
                swapped = _swap(c, record, expected_version)
                return Reserved() if swapped == _OWN else Conflict(_load(c, record.zone, record.key))
            refused = _pause_or_cap(c, record.zone, paused, cap)
            if refused is not None:
                return refused
            _save(c, record)
            return Reserved()

        return await self._write(op)

    async def put(self, record: Record, expected_version: int | None) -> Conflict | None:
        return await self._write(lambda c: _cas(c, record, expected_version))

    async def refund(self, zone: str, token: str, month: str) -> None:
        def op(c: sqlite3.Connection) -> None:
            # The month the unit was counted in is kept with it; `month` is the caller's
            # guess, used only for rows written before the column was read here.
            row = c.execute(
                "DELETE FROM sends WHERE zone = ? AND token = ? RETURNING month", (zone, token)
            ).fetchone()
            if row is not None:
                c.execute("UPDATE send_counts SET n = MAX(n - 1, 0) WHERE zone = ?", (zone,))
                c.execute(
                    "UPDATE monthly SET used = MAX(used - 1, 0) WHERE zone = ? AND month = ?",
                    (zone, row[0] or month),
                )
            _refund_user(c, zone, token)

        await self._write(op)

    async def purge(self, now: float, retention: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            n = c.execute(
                "DELETE FROM events WHERE updated_at < ? AND state NOT IN (?, ?)",
                (now - retention, State.IN_FLIGHT.value, State.QUEUED.value),
            ).rowcount
            # Store-and-forward entries kept for an operator (unknown, failed) go with their record.
            c.execute(
                "DELETE FROM queue WHERE NOT EXISTS "
                "(SELECT 1 FROM events e WHERE e.zone = queue.zone AND e.key = queue.key)"
            )
            # Window entries older than any window that reads them (1h caps, AUTH lockouts).
            for (zone,) in c.execute("SELECT DISTINCT zone FROM sends").fetchall():
                _trim(c, zone, now - 2 * HOUR)
            c.execute("DELETE FROM auth_failures WHERE at < ?", (now - 2 * HOUR,))
            c.execute("DELETE FROM user_sends WHERE at < ?", (now - 2 * HOUR,))
            c.execute("DELETE FROM provider_events WHERE received_at < ?", (now - retention,))
            c.execute("DELETE FROM nonces WHERE until < ?", (now,))
            c.execute("DELETE FROM zone_audit WHERE at < ?", (now - retention,))
            return n

        return await self._write(op, heavy=True)

    async def consume_cap(self, cap: CapCheck) -> CapReached | None:
        return await self._write(lambda c: _consume(c, cap))

    # --- store-and-forward queue -------------------------------------------------------------
    async def enqueue(
        self, record: Record, expected_version: int | None, message: QueuedMessage
    ) -> Conflict | None:
        def op(c: sqlite3.Connection) -> Conflict | None:
            conflict = _cas(c, record, expected_version)
            if conflict is not None:
                return conflict
            c.execute(
                "INSERT OR REPLACE INTO queue (zone, key, lane, priority, due_at, claimed_until, "
                "enqueued_at, sender, recipients, content, smtputf8) "
                "VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?, ?, ?)",
                (
                    record.zone,
                    record.key,
                    record.lane or "",
                    message.priority,
                    record.next_attempt_at or record.updated_at,
                    record.updated_at,
                    message.sender,
                    json.dumps(list(message.recipients)),
                    message.content,
                    int(message.smtputf8),
                ),
            )
            return None

        return await self._write(op, heavy=len(message.content) >= _HEAVY_BODY)

    async def claim(self, now: float, quotas: list[tuple[str, int]], lease: float) -> list[Claimed]:
        def op(c: sqlite3.Connection) -> list[Claimed]:
            picked: list[tuple[str, str]] = []
            sql = (
                "SELECT zone, key FROM queue WHERE lane = ? AND due_at <= ? "
                "AND (claimed_until IS NULL OR claimed_until < ?) ORDER BY due_at LIMIT ?"
            )
            for lane, n in quotas:
                picked += c.execute(sql, (lane, now, now, n)).fetchall()
            room = sum(n for _, n in quotas) - len(picked)
            for lane, _ in quotas:
                if room <= 0:
                    break
                taken = set(picked)
                more = [
                    row
                    for row in c.execute(sql, (lane, now, now, room + len(picked)))
                    if tuple(row) not in taken
                ][:room]
                picked += more
                room -= len(more)
            out: list[Claimed] = []
            for zone, key in picked:
                c.execute(
                    "UPDATE queue SET claimed_until = ? WHERE zone = ? AND key = ?", (now + lease, zone, key)
                )
                rec = _load(c, zone, key)
                row = c.execute(
                    "SELECT sender, recipients, content, priority, smtputf8 FROM queue "
                    "WHERE zone = ? AND key = ?",
                    (zone, key),
                ).fetchone()
                if rec is None or row is None:
                    c.execute("DELETE FROM queue WHERE zone = ? AND key = ?", (zone, key))
                    continue
                msg = QueuedMessage(
                    row[0], tuple(json.loads(row[1])), bytes(row[2]), int(row[3]), bool(row[4])
                )
                out.append(Claimed(rec, msg))
            return out

        # Reads up to one body per worker: on the writer thread, off the event loop.
        return await self._write(op, heavy=True)

    async def requeue(self, record: Record, expected_version: int, due: float | None) -> Conflict | None:
        def op(c: sqlite3.Connection) -> Conflict | None:
            conflict = _cas(c, record, expected_version)
            if conflict is not None:
                return conflict
            if due is None:
                c.execute("DELETE FROM queue WHERE zone = ? AND key = ?", (record.zone, record.key))
            else:
                c.execute(
                    "UPDATE queue SET due_at = ?, claimed_until = NULL WHERE zone = ? AND key = ?",
                    (due, record.zone, record.key),
                )
            return None

        return await self._write(op)

    async def queue_entries(self, zone: str | None) -> list[QueueEntry]:
        def op(c: sqlite3.Connection) -> list[QueueEntry]:
            rows = c.execute(
                "SELECT q.zone, q.key, q.lane, e.state, q.due_at, q.claimed_until, q.enqueued_at, "
                "LENGTH(q.content) FROM queue q LEFT JOIN events e ON e.zone = q.zone AND e.key = q.key "
                "WHERE (? IS NULL OR q.zone = ?) ORDER BY q.priority, q.due_at",
                (zone, zone),
            ).fetchall()
            now = time.time()
            return [
                QueueEntry(
                    z,
                    k,
                    lane,
                    state or "?",
                    None if due >= HELD else due,
                    claimed is not None and claimed > now,
                    enq,
                    size,
                )
                for z, k, lane, state, due, claimed, enq, size in rows
            ]

        return await self._read(op)

    async def queue_depths(self) -> dict[tuple[str, str], int]:
        rows = await self._read(
            lambda c: c.execute("SELECT zone, lane, COUNT(*) FROM queue GROUP BY zone, lane").fetchall()
        )
        return {(str(zone), str(lane)): int(n) for zone, lane, n in rows}

    # --- zones -------------------------------------------------------------------------------
    async def set_paused(self, zone: str, paused: bool) -> None:
        def op(c: sqlite3.Connection) -> None:
            if paused:
                c.execute("INSERT OR IGNORE INTO paused (zone) VALUES (?)", (zone,))
            else:
                c.execute("DELETE FROM paused WHERE zone = ?", (zone,))

        await self._write(op)

    async def is_paused(self, zone: str) -> bool:
        return await self._read(
            lambda c: c.execute("SELECT 1 FROM paused WHERE zone = ?", (zone,)).fetchone() is not None
        )

    async def set_class_paused(self, zone: str, message_class: str, paused: bool) -> None:
        def op(c: sqlite3.Connection) -> None:
            if paused:
                c.execute(
                    "INSERT OR IGNORE INTO paused_classes (zone, class) VALUES (?, ?)", (zone, message_class)
                )
            else:
                c.execute("DELETE FROM paused_classes WHERE zone = ? AND class = ?", (zone, message_class))

        await self._write(op)

    async def paused_classes(self) -> set[tuple[str, str]]:
        def op(c: sqlite3.Connection) -> set[tuple[str, str]]:
            return {(str(z), str(k)) for z, k in c.execute("SELECT zone, class FROM paused_classes")}

        return await self._read(op)

    async def user_cap_usage(
        self, zone: str, usernames: list[str], now: float, month: str
    ) -> dict[str, CapUsage]:
        def op(c: sqlite3.Connection) -> dict[str, CapUsage]:
            out = {}
            for user in usernames:
                hour = c.execute(
                    "SELECT COUNT(*) FROM user_sends WHERE zone = ? AND username = ? AND at >= ?",
                    (zone, user, now - HOUR),
                ).fetchone()[0]
                row = c.execute(
                    "SELECT used FROM user_monthly WHERE zone = ? AND username = ? AND month = ?",
                    (zone, user, month),
                ).fetchone()
                out[user] = CapUsage(hour=int(hour), month=int(row[0]) if row else 0)
            return out

        return await self._read(op)

    async def cap_usage(self, zone: str, now: float, month: str) -> CapUsage:
        def op(c: sqlite3.Connection) -> CapUsage:
            hour = c.execute(
                "SELECT COUNT(*) FROM sends WHERE zone = ? AND at >= ?", (zone, now - HOUR)
            ).fetchone()[0]
            row = c.execute("SELECT used FROM monthly WHERE zone = ? AND month = ?", (zone, month)).fetchone()
            return CapUsage(hour=int(hour), month=int(row[0]) if row else 0)

        return await self._read(op)

    async def add_counts(self, zone: str, counts: dict[str, int]) -> None:
        def op(c: sqlite3.Connection) -> None:
            c.executemany(
                "INSERT INTO counters (zone, name, value) VALUES (?, ?, ?) "
                "ON CONFLICT (zone, name) DO UPDATE SET value = value + excluded.value",
                [(zone, name, n) for name, n in counts.items()],
            )

        await self._write(op)

    async def counts(self, zone: str) -> dict[str, int]:
        rows = await self._read(
            lambda c: c.execute("SELECT name, value FROM counters WHERE zone = ?", (zone,)).fetchall()
        )
        return {name: int(value) for name, value in rows}

    # --- suppression -------------------------------------------------------------------------
    async def suppressed(self, zone: str, address: str) -> str | None:
        addr = suppression_key(address)

        def op(c: sqlite3.Connection) -> str | None:
            row = c.execute(
                "SELECT zone FROM suppression WHERE address = ? AND zone IN (?, 'global') "
                "ORDER BY zone = 'global' LIMIT 1",
                (addr, zone),
            ).fetchone()
            return str(row[0]) if row else None

        return await self._read(op)

    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        addr = suppression_key(address)

        def op(c: sqlite3.Connection) -> bool:
            added = c.execute(
                "INSERT OR IGNORE INTO suppression (zone, address, reason, at) VALUES (?, ?, ?, ?)",
                (zone, addr, reason, now),
            ).rowcount
            if added:
                _bump_supp_version(c, zone)
            return added == 1

        return await self._write(op)

    async def suppress_remove(self, zone: str, address: str) -> bool:
        addr = suppression_key(address)

        def op(c: sqlite3.Connection) -> bool:
            removed = c.execute(
                "DELETE FROM suppression WHERE zone = ? AND address = ?", (zone, addr)
            ).rowcount
            if removed:
                _bump_supp_version(c, zone)
            return removed == 1

        return await self._write(op)

    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        def op(c: sqlite3.Connection) -> tuple[int, int]:
            rows = dict(
                c.execute("SELECT zone, v FROM supp_versions WHERE zone IN (?, 'global')", (zone,)).fetchall()
            )
            return int(rows.get(zone, 0)), int(rows.get("global", 0))

        return await self._read(op)

    async def suppress_list(self, zone: str) -> list[Suppression]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT zone, address, reason, at FROM suppression WHERE zone = ? ORDER BY address",
                (zone,),
            ).fetchall()
        )
        return [Suppression(z, a, r, float(t)) for z, a, r, t in rows]

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
        data = json.dumps(event.to_dict(), separators=(",", ":"))

        def op(c: sqlite3.Connection) -> bool:
            added = c.execute(
                "INSERT OR IGNORE INTO provider_events (zone, source, event_id, key, received_at, data) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (zone, event.source, event.id, key, event.received_at, data),
            ).rowcount
            if not added:
                return False
            if suppress_reason is not None and event.recipient is not None:
                listed = c.execute(
                    "INSERT OR IGNORE INTO suppression (zone, address, reason, at) VALUES (?, ?, ?, ?)",
                    (zone, suppression_key(event.recipient), suppress_reason, event.received_at),
                ).rowcount
                if listed:
                    _bump_supp_version(c, zone)
            return True

        return await self._write(op)

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
        def op(c: sqlite3.Connection) -> None:
            c.execute(
                "INSERT INTO zone_audit (zone, at, actor, action, key, note) VALUES (?, ?, ?, ?, ?, ?)",
                (zone, entry.at, entry.actor, entry.action, entry.key, entry.note),
            )

        await self._write(op)

    async def audit_log(self, zone: str, since: float, limit: int = 1000) -> list[ZoneAudit]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT at, actor, action, key, note FROM zone_audit WHERE zone = ? AND at >= ? "
                "ORDER BY at DESC LIMIT ?",
                (zone, since, limit),
            ).fetchall()
        )
        return [ZoneAudit(float(at), actor, action, key, note) for at, actor, action, key, note in rows]

    # --- provider health ---------------------------------------------------------------------
    async def set_circuit(self, instance: str, provider: str, circuit: str, now: float) -> None:
        await self._write(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO circuits (instance, provider, circuit, at) VALUES (?, ?, ?, ?)",
                (instance, provider, circuit, now),
            )
        )

    async def circuits(self) -> list[CircuitState]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT instance, provider, circuit, at FROM circuits ORDER BY provider, instance"
            ).fetchall()
        )
        return [CircuitState(i, p, s, float(t)) for i, p, s, t in rows]

    async def set_probe(self, instance: str, provider: str, ready: bool, detail: str, now: float) -> None:
        await self._write(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO probes (instance, provider, ready, detail, at) "
                "VALUES (?, ?, ?, ?, ?)",
                (instance, provider, int(ready), detail, now),
            )
        )

    async def probes(self) -> list[ProbeState]:
        rows = await self._read(
            lambda c: c.execute(
                "SELECT instance, provider, ready, detail, at FROM probes ORDER BY provider, instance"
            ).fetchall()
        )
        return [ProbeState(i, p, bool(r), d, float(t)) for i, p, r, d, t in rows]

    # --- provider throttling -----------------------------------------------------------------
    async def rate_slot(self, provider: str, interval: float, max_wait: float, now: float) -> Slot:
        def op(c: sqlite3.Connection) -> Slot:
            # Inside the writer's BEGIN IMMEDIATE: other processes on the file wait for it.
            row = c.execute("SELECT tat FROM rate_slots WHERE provider = ?", (provider,)).fetchone()
            slot = gcra(float(row[0]) if row else None, now, interval, max_wait)
            if slot.granted or (row is not None and slot.tat != float(row[0])):
                c.execute(
                    "INSERT OR REPLACE INTO rate_slots (provider, tat) VALUES (?, ?)", (provider, slot.tat)
                )
            return slot

        return await self._write(op)

    async def set_throttled(self, provider: str, until: float) -> None:
        await self._write(
            lambda c: c.execute(
                "INSERT INTO throttles (provider, until) VALUES (?, ?) "
                "ON CONFLICT (provider) DO UPDATE SET until = max(until, excluded.until)",
                (provider, until),
            )
        )

    async def throttled(self, now: float) -> dict[str, float]:
        rows = await self._read(
            lambda c: c.execute("SELECT provider, until FROM throttles WHERE until > ?", (now,)).fetchall()
        )
        return {str(p): float(u) for p, u in rows}

    async def hold_connection(self, provider: str, holder: str, limit: int, until: float, now: float) -> bool:
        def op(c: sqlite3.Connection) -> bool:
            c.execute("DELETE FROM connection_slots WHERE provider = ? AND until <= ?", (provider, now))
            mine = c.execute(
                "UPDATE connection_slots SET until = ? WHERE provider = ? AND holder = ?",
                (until, provider, holder),
            ).rowcount
            if mine:
                return True
            held = c.execute(
                "SELECT COUNT(*) FROM connection_slots WHERE provider = ?", (provider,)
            ).fetchone()[0]
            if int(held) >= limit:
                return False
            c.execute(
                "INSERT INTO connection_slots (provider, holder, until) VALUES (?, ?, ?)",
                (provider, holder, until),
            )
            return True

        return await self._write(op)

    async def drop_connection(self, provider: str, holder: str) -> None:
        await self._write(
            lambda c: c.execute(
                "DELETE FROM connection_slots WHERE provider = ? AND holder = ?", (provider, holder)
            )
        )

    # --- AUTH brute force --------------------------------------------------------------------
    async def auth_failure(self, ip: str, now: float, window: float) -> int:
        def op(c: sqlite3.Connection) -> int:
            c.execute("INSERT INTO auth_failures (ip, at) VALUES (?, ?)", (ip, now))
            return int(
                c.execute(
                    "SELECT COUNT(*) FROM auth_failures WHERE ip = ? AND at > ?", (ip, now - window)
                ).fetchone()[0]
            )

        return await self._write(op)

    async def auth_failures(self, ip: str, now: float, window: float) -> int:
        return await self._read(
            lambda c: int(
                c.execute(
                    "SELECT COUNT(*) FROM auth_failures WHERE ip = ? AND at > ?", (ip, now - window)
                ).fetchone()[0]
            )
        )


def _load(c: sqlite3.Connection, zone: str, key: str) -> Record | None:
    row = c.execute("SELECT data FROM events WHERE zone = ? AND key = ?", (zone, key)).fetchone()
    return Record.from_dict(json.loads(row[0])) if row else None


def _save(c: sqlite3.Connection, r: Record) -> None:
    c.execute(
        "INSERT INTO events (zone, key, version, state, updated_at, data) VALUES (?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (zone, key) DO UPDATE SET version = excluded.version, state = excluded.state, "
        "updated_at = excluded.updated_at, data = excluded.data",
        (
            r.zone,
            r.key,
            r.version,
            r.state.value,
            r.updated_at,
            json.dumps(r.to_dict(), separators=(",", ":")),
        ),
    )


def _fold_suppression_keys(c: sqlite3.Connection) -> None:
    """Entries written before suppression compared case-folded addresses are re-keyed
    (policy/senders.suppression_key), so `Bob@x` listed then stops `bob@x` now. Only rows
    that may differ are read: any upper-case ASCII letter, or any non-ASCII character."""
    rows = c.execute(
        "SELECT zone, address, reason, at FROM suppression "
        "WHERE address != lower(address) OR address GLOB '*[^ -~]*'"
    ).fetchall()
    for zone, address, reason, at in rows:
        folded = suppression_key(address)
        if folded == address:
            continue
        c.execute(
            "INSERT OR IGNORE INTO suppression (zone, address, reason, at) VALUES (?, ?, ?, ?)",
            (zone, folded, reason, at),
        )
        c.execute("DELETE FROM suppression WHERE zone = ? AND address = ?", (zone, address))
        _bump_supp_version(c, zone)


def _bump_supp_version(c: sqlite3.Connection, zone: str) -> None:
    c.execute(
        "INSERT INTO supp_versions (zone, v) VALUES (?, 1) ON CONFLICT (zone) DO UPDATE SET v = v + 1",
        (zone,),
    )


_ID_COLUMNS: dict[IdField, str] = {"sg_id": "sg_id", "message_id": "message_id", "upstream_id": "upstream_id"}

_OWN = "own"
"""_swap's answer when the record already equals the one being written: a retried write
whose first run landed (DESIGN.md §11.4)."""


def _swap(c: sqlite3.Connection, r: Record, expected_version: int | None) -> Conflict | str | None:
    """Write `r` over exactly `expected_version` (None: only if absent) in one statement;
    the current record is read only when the swap fails. None: written; _OWN: it was
    already there, byte for byte; else the Conflict with the current record."""
    data = json.dumps(r.to_dict(), separators=(",", ":"))
    if expected_version is None:
        written = c.execute(
            "INSERT OR IGNORE INTO events (zone, key, version, state, updated_at, data) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (r.zone, r.key, r.version, r.state.value, r.updated_at, data),
        ).rowcount
    else:
        written = c.execute(
            "UPDATE events SET version = ?, state = ?, updated_at = ?, data = ? "
            "WHERE zone = ? AND key = ? AND version = ?",
            (r.version, r.state.value, r.updated_at, data, r.zone, r.key, expected_version),
        ).rowcount
    if written == 1:
        return None
    row = c.execute("SELECT version, data FROM events WHERE zone = ? AND key = ?", (r.zone, r.key)).fetchone()
    if row is None:
        return Conflict(None)
    if row[0] == r.version and row[1] == data:
        return _OWN
    return Conflict(Record.from_dict(json.loads(row[1])))


def _cas(c: sqlite3.Connection, r: Record, expected_version: int | None) -> Conflict | None:
    swapped = _swap(c, r, expected_version)
    return swapped if isinstance(swapped, Conflict) else None


def _pause_or_cap(
    c: sqlite3.Connection, zone: str, paused: bool, cap: CapCheck | None
) -> Paused | CapReached | None:
    if paused or c.execute("SELECT 1 FROM paused WHERE zone = ?", (zone,)).fetchone():
        return Paused()
    return _consume(c, cap) if cap is not None else None


def _consume(c: sqlite3.Connection, cap: CapCheck) -> CapReached | None:
    """One unit of the zone's caps and, when the user has caps of its own, one of the
    user's (DESIGN.md §16): both or neither, in the one transaction."""
    refused = _consume_zone(c, cap)
    if refused is not None or cap.user is None or cap.user_caps is None:
        return refused
    refused = _consume_user(c, cap.zone, cap.user, cap.user_caps, cap)
    if refused is not None:
        c.execute("DELETE FROM sends WHERE zone = ? AND token = ?", (cap.zone, cap.token))
        c.execute("UPDATE send_counts SET n = MAX(n - 1, 0) WHERE zone = ?", (cap.zone,))
        _uncount_month(c, cap)
    return refused


def _consume_user(
    c: sqlite3.Connection, zone: str, user: str, caps: Caps, cap: CapCheck
) -> CapReached | None:
    """One unit of a user's own caps, exact: every unit is a row, counted in the window."""
    if not c.execute(
        "INSERT OR IGNORE INTO user_sends (zone, token, username, at, month) VALUES (?, ?, ?, ?, ?)",
        (zone, cap.token, user, cap.now, cap.month),
    ).rowcount:
        return None  # counted by an earlier run of this call (DESIGN.md §11.4)
    used = c.execute(
        "INSERT INTO user_monthly (zone, username, month, used) VALUES (?, ?, ?, 1) "
        "ON CONFLICT (zone, username, month) DO UPDATE SET used = used + 1 RETURNING used",
        (zone, user, cap.month),
    ).fetchone()[0]
    reached: CapReached | None = None
    if used > caps.monthly:
        reached = CapReached("month", caps.monthly, user=user)
    else:
        n, oldest = c.execute(
            "SELECT COUNT(*), MIN(CASE WHEN token != ? THEN at END) FROM user_sends "
            "WHERE zone = ? AND username = ? AND at >= ?",
            (cap.token, zone, user, cap.hour_start),
        ).fetchone()
        if n > caps.hourly:
            reached = CapReached("hour", caps.hourly, (oldest or cap.now) + HOUR, user=user)
    if reached is not None:
        c.execute("DELETE FROM user_sends WHERE zone = ? AND token = ?", (zone, cap.token))
        c.execute(
            "UPDATE user_monthly SET used = used - 1 WHERE zone = ? AND username = ? AND month = ?",
            (zone, user, cap.month),
        )
    return reached


def _refund_user(c: sqlite3.Connection, zone: str, token: str) -> None:
    row = c.execute(
        "DELETE FROM user_sends WHERE zone = ? AND token = ? RETURNING username, month", (zone, token)
    ).fetchone()
    if row is not None:
        c.execute(
            "UPDATE user_monthly SET used = MAX(used - 1, 0) WHERE zone = ? AND username = ? AND month = ?",
            (zone, row[0], row[1]),
        )


def _consume_zone(c: sqlite3.Connection, cap: CapCheck) -> CapReached | None:
    """Count one unit against both caps, or refuse and count nothing.

    Optimistic: each count is raised first, in one statement that returns the new total, and
    lowered again in the rare case it went over; check and count are one transaction.
    The sliding hour is exact: every send is a row and send_counts keeps the zone's row
    count. Rows that left the hour are dropped only when the count reaches the cap (and by
    the hourly purge), so a send within the cap costs no scan and no delete."""
    zone = cap.zone
    # The token first: a token counted already is a retried call (DESIGN.md §11.4), and
    # counts nothing again.
    if not c.execute(
        "INSERT OR IGNORE INTO sends (zone, token, at, month) VALUES (?, ?, ?, ?)",
        (zone, cap.token, cap.now, cap.month),
    ).rowcount:
        return None
    used = c.execute(
        "INSERT INTO monthly (zone, month, used) VALUES (?, ?, 1) "
        "ON CONFLICT (zone, month) DO UPDATE SET used = used + 1 RETURNING used",
        (zone, cap.month),
    ).fetchone()[0]
    if used > cap.caps.monthly:
        _uncount_month(c, cap)
        c.execute("DELETE FROM sends WHERE zone = ? AND token = ?", (zone, cap.token))
        return CapReached("month", cap.caps.monthly)
    row = c.execute("UPDATE send_counts SET n = n + 1 WHERE zone = ? RETURNING n", (zone,)).fetchone()
    if row is None:
        n = c.execute("SELECT COUNT(*) FROM sends WHERE zone = ?", (zone,)).fetchone()[0]
        c.execute("INSERT INTO send_counts (zone, n) VALUES (?, ?)", (zone, n))
    else:
        n = row[0]
    if n > cap.caps.hourly:
        _trim(c, zone, cap.hour_start)
        n = c.execute("SELECT n FROM send_counts WHERE zone = ?", (zone,)).fetchone()[0]
        if n > cap.caps.hourly:
            c.execute("DELETE FROM sends WHERE zone = ? AND token = ?", (zone, cap.token))
            c.execute("UPDATE send_counts SET n = n - 1 WHERE zone = ?", (zone,))
            _uncount_month(c, cap)
            oldest = c.execute("SELECT MIN(at) FROM sends WHERE zone = ?", (zone,)).fetchone()[0]
            return CapReached("hour", cap.caps.hourly, (oldest or cap.now) + HOUR)
    return None


def _uncount_month(c: sqlite3.Connection, cap: CapCheck) -> None:
    c.execute("UPDATE monthly SET used = used - 1 WHERE zone = ? AND month = ?", (cap.zone, cap.month))


def _trim(c: sqlite3.Connection, zone: str, before: float) -> None:
    """Drop the zone's sends older than `before`, keeping send_counts equal to its rows."""
    gone = c.execute("DELETE FROM sends WHERE zone = ? AND at < ?", (zone, before)).rowcount
    if gone:
        c.execute("UPDATE send_counts SET n = MAX(n - ?, 0) WHERE zone = ?", (gone, zone))
