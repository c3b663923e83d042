"""store.url naming another application's SQLite file (DESIGN.md §18): `serve` refuses it,
naming the file and what it found, before anything in it changes (its journal mode
included), rather than adding smtpguard's tables to it; a file whose table names clash is
refused the same way. smtpguard's files carry PRAGMA application_id: a file another
application marked is refused, and an unmarked store of an earlier release (user_version
0 before numbered migrations, or a version from before the mark) opens and is marked."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from smtpguard.config import ConfigError
from smtpguard.store import Reserved, StoreUnfit, store_from_url
from smtpguard.store.sqlite import SQLiteStore, migrate
from tests.store.test_store_contract import fresh
from tests.support import Upstream, base_config, running_guard


def _app_file(path: Path, *schema: str, application_id: int = 0) -> None:
    conn = sqlite3.connect(path)
    for statement in schema:
        conn.execute(statement)
    conn.execute("INSERT INTO " + schema[0].split()[2] + " (id) VALUES (1)")
    if application_id:
        conn.execute(f"PRAGMA application_id = {application_id:d}")
    conn.commit()
    conn.close()


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _marks(path: Path) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        got = (
            conn.execute("PRAGMA application_id").fetchone()[0],
            conn.execute("PRAGMA user_version").fetchone()[0],
        )
        return int(got[0]), int(got[1])
    finally:
        conn.close()


CASES = {
    "another application's tables": (
        (
            "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)",
            "CREATE TABLE tags (id INTEGER, name TEXT)",
        ),
        0,
        "it has 2 table(s) (notes, tags), user_version 0, no application_id, and none of smtpguard's tables",
    ),
    "a clashing events table": (
        ("CREATE TABLE events (id INTEGER PRIMARY KEY, title TEXT)",),
        0,
        "it has 1 table(s) (events), user_version 0, no application_id, "
        "and events without smtpguard's columns",
    ),
    "another application's mark": (
        ("CREATE TABLE events (id INTEGER, zone, key, version, state, updated_at, data)",),
        0x0F055112,  # Fossil's
        "its application_id is 0x0f055112 (smtpguard's is 0x53475244)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_serve_refuses_a_file_that_is_not_an_smtpguard_store_and_leaves_it_as_it_was(
    tmp: Path, upstream: Upstream, case: str
) -> None:
    schema, application_id, found = CASES[case]
    folder = tmp / "app"
    folder.mkdir()
    db = folder / "app.db"
    _app_file(db, *schema, application_id=application_id)
    before = _snapshot(folder)
    with pytest.raises(ConfigError) as refused:
        async with running_guard(base_config(tmp, upstream.port, store__url=f"sqlite:///{db}")):
            pass
    print(refused.value.problems)
    assert refused.value.problems == [f"store: {db} is not an smtpguard store: {found}; check store.url"]
    assert _snapshot(folder) == before  # not a byte changed, no -wal, -shm or -lock beside it
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    conn.close()
    # The read-only opener (the CLI's history, stats …) refuses it too, rather than answering
    # "no record" from stand-in tables.
    reader = SQLiteStore(f"sqlite:///{db}", read_only=True, create=False)
    await reader.open()
    try:
        with pytest.raises(StoreUnfit, match="is not an smtpguard store"):
            await reader.get("acme", "k")
    finally:
        await reader.close()
    assert _snapshot(folder) == before


async def test_a_new_file_is_marked_as_smtpguard_s(tmp: Path) -> None:
    s = store_from_url(f"sqlite:///{tmp / 'state.db'}")
    await s.open()
    await s.close()
    assert _marks(tmp / "state.db") == (migrate.APPLICATION_ID, migrate.LATEST)


@pytest.mark.parametrize("version", [0, 2, migrate.LATEST])
async def test_an_unmarked_store_of_an_earlier_release_opens_and_is_marked(tmp: Path, version: int) -> None:
    """user_version 0: before numbered migrations (tests/store/test_sqlite_release_upgrade.py
    runs the real release); 2 and LATEST: numbered, but from before application_id."""
    url = f"sqlite:///{tmp / 'state.db'}"
    s = store_from_url(url)
    await s.open()
    assert await s.reserve(fresh("kept"), None, None, False) == Reserved()
    await s.close()
    conn = sqlite3.connect(tmp / "state.db", isolation_level=None)
    conn.execute("PRAGMA application_id = 0")
    conn.execute(f"PRAGMA user_version = {version:d}")
    conn.close()
    s = store_from_url(url)
    await s.open()
    try:
        assert (await s.get("acme", "kept")) is not None
    finally:
        await s.close()
    assert _marks(tmp / "state.db") == (migrate.APPLICATION_ID, migrate.LATEST)
