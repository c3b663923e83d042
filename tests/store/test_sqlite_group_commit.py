"""SQLite group commit: concurrent writes share a transaction, and one failing operation
fails alone (as StoreUnavailable), never the writes batched with it."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, State, Submission
from smtpguard.store import StoreUnavailable
from smtpguard.store.base import ZoneAudit
from smtpguard.store.sql import operations
from smtpguard.store.sqlite import SQLiteStore
from smtpguard.store.sqlite import writer as sqlite_store

NOW = 1_800_000_000.0


def fresh(key: str) -> ledger.Record:
    verdict = ledger.decide(
        None, Submission("acme", key, "fp", "id-" + key, "i", None), NOW, LedgerSettings()
    )
    assert isinstance(verdict, ledger.Proceed)
    return verdict.record


async def test_one_failing_operation_fails_alone(tmp_path: Path) -> None:
    store = SQLiteStore(f"sqlite:///{tmp_path / 'g.db'}")
    await store.open()
    try:

        def broken(c: sqlite3.Connection) -> None:
            c.execute("INSERT INTO no_such_table VALUES (1)")

        writes = [store.put(fresh(f"k{i}"), None) for i in range(20)]
        failing = store._write(broken)
        results = await asyncio.gather(*writes, failing, return_exceptions=True)
        assert results[:20] == [None] * 20
        assert isinstance(results[20], StoreUnavailable)
        for i in range(20):
            got = await store.get("acme", f"k{i}")
            assert got is not None and got.version == 1
        with pytest.raises(StoreUnavailable):
            await store._write(broken)
    finally:
        await store.close()


async def test_shared_scripts_batched_with_a_failing_operation_run_again_whole(tmp_path: Path) -> None:
    """Each is run a second time, alone, from its first statement (store/sql/roles.py makes
    the script afresh at each run): each address listed once, the version moved once each."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'g.db'}")
    await store.open()
    try:

        def broken(c: sqlite3.Connection) -> None:
            c.execute("INSERT INTO no_such_table VALUES (1)")

        adds = [
            asyncio.ensure_future(store.suppress_add("acme", f"a{i}@example.com", "bounce", NOW))
            for i in range(10)
        ]
        await asyncio.sleep(0)  # each has submitted its write: the failing one comes last
        results = await asyncio.gather(*adds, store._write(broken), return_exceptions=True)
        assert results[:10] == [True] * 10
        assert isinstance(results[10], StoreUnavailable)
        assert [s.address for s in await store.suppress_list("acme")] == [
            f"a{i}@example.com" for i in range(10)
        ]
        assert await store.suppression_versions("acme") == (10, 0)
    finally:
        await store.close()


async def ticks_during(seconds: float) -> int:
    """How many 10 ms sleeps the event loop completes in `seconds` (about 100 a second
    when nothing blocks it)."""
    n = 0
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
        n += 1
    return n


@contextlib.asynccontextmanager
async def store_and_rival(tmp_path: Path) -> AsyncIterator[tuple[SQLiteStore, sqlite3.Connection]]:
    """A store, and a second connection to its file holding the write lock (as the CLI,
    another process, would while it writes)."""
    path = tmp_path / "g.db"
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    rival = sqlite3.connect(path, isolation_level=None)
    try:
        rival.execute("BEGIN IMMEDIATE")
        yield store, rival
    finally:
        rival.close()
        await store.close()


async def test_a_lock_held_elsewhere_is_waited_for_off_the_event_loop(tmp_path: Path) -> None:
    """The CLI (another process) may hold the write lock: smtpguard's write waits for it on
    the writer thread, and the event loop keeps serving meanwhile."""
    async with store_and_rival(tmp_path) as (store, rival):
        write = asyncio.ensure_future(store.put(fresh("held"), None))
        ticks = await ticks_during(0.5)
        assert not write.done()
        assert ticks >= 25, f"the event loop was blocked: {ticks} ticks in 0.5 s"
        rival.execute("COMMIT")
        assert await asyncio.wait_for(write, 5) is None
        got = await store.get("acme", "held")
        assert got is not None and got.version == 1


async def test_a_lock_never_released_fails_the_write_as_store_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_store, "_BUSY_RETRY_FOR", 0.3)
    async with store_and_rival(tmp_path) as (store, rival):
        with pytest.raises(StoreUnavailable, match="locked"):
            await asyncio.wait_for(store.put(fresh("never"), None), 5)
        rival.execute("ROLLBACK")
        # The store recovers once the lock is gone.
        assert await store.put(fresh("after"), None) is None


async def test_heavy_operations_run_on_the_writer_thread(tmp_path: Path) -> None:
    """Ordinary writes run their statements on the event loop's thread (no GIL hand-off per
    statement); an operation marked heavy (the purge) runs, with its batch, on the writer
    thread, so a long transaction never stalls the event loop."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'g.db'}")
    await store.open()
    try:

        def where(c: sqlite3.Connection) -> str:
            return threading.current_thread().name

        assert await store._write(where) == threading.current_thread().name
        assert (await store._write(where, heavy=True)).startswith("smtpguard-sqlite-writer")
        settled = [replace(fresh(f"old{i}"), state=State.DELIVERED) for i in range(1000)]
        await asyncio.gather(*(store.put(r, None) for r in settled))
        assert await store.purge(NOW + 10 * 86400, 86400) == 1000
    finally:
        await store.close()


async def test_every_write_of_a_batch_is_answered_even_when_one_raises_oddly(tmp_path: Path) -> None:
    """An operation raising what a future cannot carry (StopIteration) must not leave its
    batch, or the writes queued behind it, waiting for ever."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'g.db'}")
    await store.open()
    try:

        def odd(c: sqlite3.Connection) -> None:
            raise StopIteration

        first = store.put(fresh("a"), None)
        broken = store._write(odd)
        last = store.put(fresh("b"), None)
        results = await asyncio.wait_for(asyncio.gather(first, broken, last, return_exceptions=True), 5)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], StoreUnavailable)
        assert await asyncio.wait_for(store.put(fresh("c"), None), 5) is None
    finally:
        await store.close()


async def test_an_sqlite_without_returning_is_refused_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The one fault here that cannot be caused for real: this Python links SQLite >= 3.35.
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 34, 1))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.34.1")
    store = SQLiteStore(f"sqlite:///{tmp_path / 'g.db'}")
    with pytest.raises(
        StoreUnavailable, match=r"SQLite 3\.34\.1 is too old: smtpguard needs 3\.35\.0 or newer"
    ):
        await store.open()


async def test_a_writer_waiting_for_another_writers_turn_goes_in_at_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers of one file (as `workers` run them): the second one's batch waits for
    the first one's turn and is let in when it commits, never sent to SQLite's busy retry
    (sleeps of 1 to 50 ms that left two workers idle a fifth of the time)."""
    retried: list[float] = []
    begin_waiting = sqlite_store._begin_waiting

    def counted(conn: sqlite3.Connection) -> None:
        retried.append(time.monotonic())
        begin_waiting(conn)

    path = tmp_path / "g.db"
    first, second = SQLiteStore(f"sqlite:///{path}"), SQLiteStore(f"sqlite:///{path}")
    await first.open()
    await second.open()
    monkeypatch.setattr(sqlite_store, "_begin_waiting", counted)
    try:
        entered = threading.Event()

        def long_write(c: sqlite3.Connection) -> None:
            c.execute(*operations.audit_add("acme", ZoneAudit(NOW, "op", "pause", "", "")).sqlite())
            entered.set()
            time.sleep(0.3)  # in the transaction, holding the turn and the file

        held = first._write(long_write, heavy=True)  # heavy: runs on the writer thread
        await asyncio.to_thread(entered.wait, 5)
        n = len(retried)  # the heavy batch's own BEGIN went through _begin_waiting
        results = await asyncio.wait_for(
            asyncio.gather(held, *(second.put(fresh(f"k{i}"), None) for i in range(20))), 10
        )
        assert results == [None] * 21
        assert retried[n:] == []
        for i in range(20):
            got = await first.get("acme", f"k{i}")
            assert got is not None and got.version == 1
    finally:
        await second.close()
        await first.close()


async def test_a_turn_never_given_back_delays_a_write_only_until_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer stopped while it holds its turn (the supervisor replaces it within the
    heartbeat): the others go on to SQLite's own lock after the deadline, and the turn,
    when it comes late, is given straight back rather than kept by an idle writer."""
    monkeypatch.setattr(sqlite_store, "_BUSY_RETRY_FOR", 0.3)
    path = tmp_path / "g.db"
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    stopped = os.open(f"{path}-lock", os.O_RDWR)
    try:
        fcntl.flock(stopped, fcntl.LOCK_EX)
        started = time.monotonic()
        assert await asyncio.wait_for(store.put(fresh("late"), None), 5) is None
        assert time.monotonic() - started >= 0.3
        fcntl.flock(stopped, fcntl.LOCK_UN)
        for _ in range(100):  # the late turn reaches the writer, which lets go of it
            await asyncio.sleep(0.01)
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(stopped, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
        else:
            raise AssertionError("the turn that came late was kept")
        fcntl.flock(stopped, fcntl.LOCK_UN)
        assert await asyncio.wait_for(store.put(fresh("after"), None), 5) is None
    finally:
        os.close(stopped)
        await store.close()


async def test_closing_the_store_ends_its_writer_threads(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    store = SQLiteStore(f"sqlite:///{tmp_path / 'g.db'}")
    await store.open()
    await store.put(fresh("a"), None)
    names = {t.name.rstrip("_0123456789") for t in set(threading.enumerate()) - before}
    assert names >= {"smtpguard-sqlite-writer", "smtpguard-sqlite-turn"}
    await store.close()
    assert [t.name for t in set(threading.enumerate()) - before] == []


async def test_a_turn_file_that_cannot_be_opened_leaves_writes_to_sqlites_lock(tmp_path: Path) -> None:
    path = tmp_path / "g.db"
    (tmp_path / "g.db-lock").symlink_to(tmp_path / "missing" / "lock")
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    try:
        assert await asyncio.gather(*(store.put(fresh(f"k{i}"), None) for i in range(5))) == [None] * 5
        got = await store.get("acme", "k4")
        assert got is not None and got.version == 1
    finally:
        await store.close()
