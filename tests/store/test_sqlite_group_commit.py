"""SQLite group commit: concurrent writes share a transaction, and one failing operation
fails alone (as StoreUnavailable), never the writes batched with it."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, State, Submission
from smtpguard.store import StoreUnavailable
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
