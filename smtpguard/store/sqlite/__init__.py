"""SQLite backend: the embedded default, one process, no server.

Writes go through one writer thread that groups every write waiting at that moment into a
single transaction and a single fsync (group commit). Durability is not relaxed: WAL with
synchronous=FULL, and no coroutine learns its write succeeded before COMMIT returned. Under
load, fifty concurrent reservations cost one fsync instead of fifty. Reads use their own
connections in a small thread pool, so the event loop never blocks on SQLite.

SQLiteStore (here) opens the file and keeps the ledger and queue operations; the rest of the
package: writer.py (group commit), access.py (the writer and readers every role goes
through), controls.py, desk.py, fleet.py (one class per role, inherited, each over the
shared roles of store/sql/roles.py), rows.py (record rows and their compare-and-swap),
caps.py (cap units), schema.py (connections, read-only stand-ins) and migrate.py with
migrations/ (the schema, by PRAGMA user_version).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from smtpguard.policy.ledger import Record
from smtpguard.policy.limits import WINDOW_KEEP, CapCheck, CapReached
from smtpguard.store.base import (
    Claimed,
    Conflict,
    QueuedMessage,
    Reserved,
    ReserveResult,
    StoreMissing,
    StoreUnavailable,
    StoreUnfit,
    entry_columns,
)
from smtpguard.store.errors import Probed
from smtpguard.store.sql.purge import ORPHANED_ENTRIES, aged_out, purgeable
from smtpguard.store.sql.statements import Plan
from smtpguard.store.sqlite.access import Access
from smtpguard.store.sqlite.caps import _consume, _pause_or_cap, _refund_user, _trim
from smtpguard.store.sqlite.checks import cannot_write
from smtpguard.store.sqlite.controls import Controls
from smtpguard.store.sqlite.desk import Desk
from smtpguard.store.sqlite.fleet import Fleet
from smtpguard.store.sqlite.rows import _OWN, _cas, _fold_suppression_keys, _load, _swap
from smtpguard.store.sqlite.rows import _save as _save  # bench/desk.py writes rows with it
from smtpguard.store.sqlite.schema import _MIN_SQLITE
from smtpguard.store.sqlite.schema import path_from_url as path_from_url
from smtpguard.store.sqlite.writer import _Writer

log = logging.getLogger("smtpguard.store")
_HEAVY_BODY = 64 * 1024
"""A queued message body at least this large is written on the writer thread (its pages
spill to the WAL), not on the event loop's."""


class SQLiteStore(Probed, Controls, Desk, Fleet, Access):
    def __init__(self, url: str, read_only: bool = False, create: bool = True) -> None:
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
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnfit(f"cannot create {self.path.parent}: {e.strerror}") from None
        writer = _Writer(self.path)
        try:
            await writer.open()
        except StoreUnfit:
            await writer.close()
            raise
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

    async def _refusal(self) -> str | None:
        def probe(c: sqlite3.Connection) -> str | None:
            c.execute("SELECT 1").fetchone()
            # The writer's connection was found writable at open; what can change since is
            # the file system (remounted read-only after an I/O error) or the file's mode.
            return cannot_write(self.path)

        return await self._read(probe)

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
        # The rule is shared (store/sql/purge.py); here every record it takes goes in one
        # statement, the writer's transaction holding the file.
        def op(c: sqlite3.Connection) -> int:
            where = purgeable(now - retention, now)
            n = c.execute(*Plan(f"DELETE FROM events WHERE {where.sql}", where.params).sqlite()).rowcount
            c.execute(*ORPHANED_ENTRIES.sqlite())
            # Each zone's window trimmed with its send_counts, kept equal to its rows (caps.py).
            for (zone,) in c.execute("SELECT DISTINCT zone FROM sends").fetchall():
                _trim(c, zone, now - WINDOW_KEEP)
            for plan in aged_out(now, retention):
                c.execute(*plan.sqlite())
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
                    *entry_columns(record, message),
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
