"""The SQLite schema kept as numbered migrations counted in PRAGMA user_version (DESIGN.md
§18): a new file and a file of an earlier release end at the latest version, each migration
runs once, two openers at once run it once between them, a failing migration leaves the file
at the version before, and a file of a newer release opens as it is."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from smtpguard.store import Reserved, StoreUnavailable, store_from_url
from smtpguard.store.sqlite import migrate
from smtpguard.store.sqlite.schema import _connect
from tests.store.test_store_contract import fresh


def _version(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


def _objects(path: Path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {str(name) for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    finally:
        conn.close()


async def _open_close(url: str) -> None:
    s = store_from_url(url)
    await s.open()
    await s.close()


def test_the_migrations_are_numbered_from_one_without_a_gap() -> None:
    names = sorted(p.name for p in (Path(migrate.__file__).parent / "migrations").glob("*.sql"))
    assert [int(name.split("_", 1)[0]) for name in names] == list(range(1, len(names) + 1))
    assert migrate.LATEST == len(names) == len(migrate.MIGRATIONS) >= 2


async def test_a_new_file_ends_at_the_latest_version_with_every_table(tmp_path: Path) -> None:
    await _open_close(f"sqlite:///{tmp_path / 'state.db'}")
    assert _version(tmp_path / "state.db") == migrate.LATEST
    objects = _objects(tmp_path / "state.db")
    assert {"events", "queue", "user_monthly", "state_counts", "events_count_update"} <= objects


async def test_each_migration_runs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A migration after the ones a file has runs at the next open, and never again: its
    plain CREATE TABLE would fail on a second run."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    await _open_close(url)
    extra = "-- Version N: a table of a later release.\nCREATE TABLE later (x INTEGER NOT NULL);\n"
    monkeypatch.setattr(migrate, "MIGRATIONS", [*migrate.MIGRATIONS, extra])
    monkeypatch.setattr(migrate, "LATEST", migrate.LATEST + 1)
    for _ in range(3):
        await _open_close(url)
        assert _version(tmp_path / "state.db") == migrate.LATEST
    assert "later" in _objects(tmp_path / "state.db")


async def test_two_openers_of_a_new_file_at_once_migrate_it_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    stores = [store_from_url(url) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        results = await asyncio.gather(
            *(s.reserve(fresh(f"k{i}"), None, None, False) for i, s in enumerate(stores))
        )
        assert results == [Reserved()] * 4
        # The state counts were created (and seeded) once: four records, counted once each.
        assert await stores[0].state_counts("acme") == {State.IN_FLIGHT.value: 4}
    finally:
        for s in stores:
            await s.close()
    assert _version(tmp_path / "state.db") == migrate.LATEST


async def test_a_failing_migration_leaves_the_file_at_the_version_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    s = store_from_url(url)
    await s.open()
    assert await s.reserve(fresh("kept"), None, None, False) == Reserved()
    await s.close()
    broken = "CREATE TABLE half (x INTEGER);\nCREATE TABLE events (x INTEGER);\n"
    monkeypatch.setattr(migrate, "MIGRATIONS", [*migrate.MIGRATIONS, broken])
    monkeypatch.setattr(migrate, "LATEST", migrate.LATEST + 1)
    with pytest.raises(StoreUnavailable, match=r"cannot open .*events already exists"):
        await _open_close(url)
    assert _version(tmp_path / "state.db") == migrate.LATEST - 1
    assert "half" not in _objects(tmp_path / "state.db")  # rolled back with the rest
    monkeypatch.undo()
    again = store_from_url(url)
    await again.open()
    try:
        kept = await again.get("acme", "kept")
        assert kept is not None and kept.key == "kept"
    finally:
        await again.close()


async def test_a_file_of_a_newer_release_opens_as_it_is(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    await _open_close(url)
    conn = sqlite3.connect(tmp_path / "state.db")
    conn.execute(f"PRAGMA user_version = {migrate.LATEST + 5}")
    conn.commit()
    conn.close()
    s = store_from_url(url)
    await s.open()
    try:
        assert await s.reserve(fresh("k"), None, None, False) == Reserved()
    finally:
        await s.close()
    assert _version(tmp_path / "state.db") == migrate.LATEST + 5


async def test_a_file_of_an_earlier_release_is_adopted_at_the_version_it_matches(tmp_path: Path) -> None:
    """Version 0 (before numbered migrations) missing tables, the queue's SMTPUTF8 column and
    the state counts: each is added, once, and the counts include the records there."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    s = store_from_url(url)
    await s.open()
    for key in ("a", "b"):
        assert await s.reserve(fresh(key), None, None, False) == Reserved()
    await s.close()
    conn = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    for trigger in ("events_count_insert", "events_count_update", "events_count_delete"):
        conn.execute(f"DROP TRIGGER {trigger}")
    for table in ("state_counts", "paused_classes", "probes"):
        conn.execute(f"DROP TABLE {table}")
    conn.execute("ALTER TABLE queue DROP COLUMN smtputf8")
    conn.execute("PRAGMA user_version = 0")
    conn.close()

    s = store_from_url(url)
    await s.open()
    try:
        assert await s.state_counts("acme") == {State.IN_FLIGHT.value: 2}
        assert await s.paused_classes() == set() and await s.probes() == []
    finally:
        await s.close()
    assert _version(tmp_path / "state.db") == migrate.LATEST
    conn = sqlite3.connect(tmp_path / "state.db")
    columns = [row[1] for row in conn.execute("PRAGMA table_info(queue)")]
    conn.close()
    assert columns.count("smtputf8") == 1


def test_a_new_file_held_by_another_opener_is_waited_for_not_refused(tmp_path: Path) -> None:
    """Switching a file into WAL takes an exclusive lock, and SQLite answers "database is
    locked" at once (no busy handler) while another connection holds it: four stores
    opening one new file together failed 1 time in 30 before the opener waited."""
    path = tmp_path / "state.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("CREATE TABLE t (x)")
    released = threading.Event()

    def release() -> None:
        holder.execute("COMMIT")
        released.set()

    timer = threading.Timer(0.3, release)
    timer.start()
    try:
        conn = _connect(path)
        assert released.is_set()
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        conn.close()
    finally:
        timer.join()
        holder.close()
