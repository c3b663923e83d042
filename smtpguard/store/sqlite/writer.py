"""The group-commit writer: one transaction and one fsync for every write waiting at that
moment (the package's docstring says why)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import sqlite3
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from smtpguard.store.base import StoreUnavailable
from smtpguard.store.sqlite.checks import check_writable, unwritable
from smtpguard.store.sqlite.migrate import migrate
from smtpguard.store.sqlite.schema import _connect, execute_waiting

T = TypeVar("T")
log = logging.getLogger("smtpguard.store")
_MAX_BATCH = 512

_Op = Callable[[sqlite3.Connection], Any]
_Result = tuple["asyncio.Future[Any]", Any, BaseException | None]
_BUSY_RETRY_FOR = 30.0
"""Seconds a write waits for the database lock held by another process (the CLI)."""


class _Thread:
    """A thread that runs what the event loop hands it, one call at a time, answering each
    with one call_soon_threadsafe: where _Turn waits for a turn. Not a ThreadPoolExecutor:
    its threads are joined at interpreter exit, and a turn that never comes (a holder
    stopped without dying) would keep the process from ever leaving."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, fut, fn, args))
        return fut

    def shutdown_nowait(self) -> None:
        self._calls.put(None)

    def shutdown(self) -> None:
        """Stop after the calls already handed over; returns when the thread has ended."""
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, fut, fn, args = call
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as e:  # the caller decides; the thread carries on
                outcome = (None, e)
            del call, fn, args
            # A turn coming after the event loop closed has no one left to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, *outcome)
            del fut, outcome


class _Turn:
    """Whose turn it is to write, among the processes writing one file (`workers`).

    SQLite answers a BEGIN IMMEDIATE that finds the file locked with "busy" at once, and a
    waiting writer can only try again after a sleep (_begin_waiting: 1 ms doubling to
    50 ms): two processes writing at 50 sessions each slept 0.2 to 1.0 s of every 3.5 s.
    Each batch first takes an exclusive flock on the file's `-lock` companion, and the
    kernel wakes the next writer the moment the holder lets go (right after its COMMIT).
    The turn only orders writers: the transaction is still guarded by SQLite's own lock
    (migrations and any other SQLite client write without a turn), so a turn lost or
    never had costs waiting, not safety."""

    def __init__(self, path: Path) -> None:
        try:
            # Read access is all flock needs: a file left by another user (a CLI command
            # run as root) still serves; where none opens, writes go on under SQLite's lock alone.
            self._fd = _open_plain(f"{path}-lock")
        except OSError as e:
            log.warning("sqlite write turns unavailable", extra={"error": repr(e)})
            self._fd = -1
        self._waiter = _Thread("smtpguard-sqlite-turn")
        self._coming: asyncio.Future[None] | None = None
        self._late = 0
        """Turns waited for by a batch that went on without them, and not come yet."""
        self.held = False

    async def take(self) -> None:
        if self.held or self._fd < 0:
            return
        if self._coming is None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self._late:
                    # The holder kept a turn past the deadline and still has it (stopped):
                    # straight on to SQLite's lock, rather than every batch waiting out
                    # the deadline again until the supervisor replaces the holder.
                    return
                self._coming = self._waiter.call(fcntl.flock, self._fd, fcntl.LOCK_EX)
            else:
                self.held = True
                return
        try:
            # A holder that stopped without dying is replaced by the supervisor; until then
            # the batch goes on without the turn, to SQLite's own lock and its deadline.
            await asyncio.wait_for(asyncio.shield(self._coming), _BUSY_RETRY_FOR)
        except TimeoutError:
            late, self._coming = self._coming, None
            self._late += 1
            late.add_done_callback(self._given_back)
            return
        self._coming = None
        self.held = True

    def _given_back(self, late: asyncio.Future[None]) -> None:
        """A turn that came after its batch had stopped waiting goes straight back."""
        self._late -= 1
        if self._fd >= 0 and not self.held and not late.cancelled() and late.exception() is None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def give(self) -> None:
        if self.held:
            self.held = False
            self.let_go()

    def let_go(self) -> None:
        """Let the next writer in now, from the writer thread right after COMMIT, rather
        than after the event loop has heard of it; give() follows on the loop."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        # Closing the descriptor lets go of a turn held; a waiter still blocked on a turn
        # coming, or on one that came too late for its batch, ends when it comes (a daemon
        # thread, holding the file until then): joined, it would stop the event loop.
        if self._coming is None and not self._late:
            self._waiter.shutdown()
        else:
            self._waiter.shutdown_nowait()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _open_plain(name: str) -> int:
    """The turn file, only as a plain file of its own: a `-lock` planted as a link by
    whoever may write the folder would have the store create (as its user) or lock a file
    of the link's choosing, and a FIFO would hold the open, on the event loop's thread,
    until something opened it to write (O_NONBLOCK, cleared again once it is known plain)."""
    flags = os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(name, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        self._turn: _Turn | None = None

    async def open(self) -> None:
        def connect() -> sqlite3.Connection:
            try:
                conn = _connect(self._path)
                check_writable(conn, self._path)
                migrate(conn)
            except sqlite3.Error as e:
                refused = unwritable(self._path, e)
                if refused is None:
                    raise
                raise refused from None
            # The loop thread must never wait on a lock held by another process: a busy
            # BEGIN is retried on the writer thread instead (_begin_waiting).
            conn.execute("PRAGMA busy_timeout = 0")
            return conn

        self._conn = await asyncio.get_running_loop().run_in_executor(self._thread, connect)
        self._turn = _Turn(self._path)

    async def close(self) -> None:
        while self._flushing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._flushing)
        conn, self._conn = self._conn, None
        if conn is not None:
            await asyncio.get_running_loop().run_in_executor(self._thread, conn.close)
        self._thread.shutdown(wait=True)
        if self._turn is not None:
            self._turn.close()

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
                assert self._turn is not None
                try:
                    await self._turn.take()
                    if any(heavy for _, _, heavy in batch):
                        loop = asyncio.get_running_loop()
                        results = await loop.run_in_executor(self._thread, self._run_batch_blocking, ops)
                    else:
                        results = await self._run_batch(ops)
                except BaseException as e:
                    self._turn.give()
                    # Cancelled while COMMIT ran (it may still complete) or a bug: the
                    # callers hear "unavailable", the lease and the ledger sort out the rest.
                    _settle_all(_failed(ops, e))
                    raise
                self._turn.give()
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
            await loop.run_in_executor(self._thread, _commit, conn, self._turn)
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
            _commit(conn, self._turn)
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


def _commit(conn: sqlite3.Connection, turn: _Turn | None) -> None:
    try:
        conn.execute("COMMIT")
    finally:
        if turn is not None and turn.held:
            turn.let_go()


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
    execute_waiting(conn, "BEGIN IMMEDIATE", _BUSY_RETRY_FOR, 0.001, 0.05, ("locked", "busy"))


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
        _settle(fut, value, error)


def _settle(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(value)
    elif isinstance(error, Exception) and not isinstance(error, StopIteration):
        fut.set_exception(error)
    else:
        # What a future refuses to carry (StopIteration, a cancellation): still an answer.
        fut.set_exception(StoreUnavailable(f"sqlite write failed: {error!r}"))
