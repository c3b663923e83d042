"""SQLite group commit: concurrent writes share a transaction, and one failing operation
fails alone (as StoreUnavailable), never the writes batched with it."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, Submission
from smtpguard.store import StoreUnavailable
from smtpguard.store.sqlite import SQLiteStore

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
