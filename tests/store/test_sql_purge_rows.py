"""The purge's rule (store/sql/purge.py) on both SQL stores over records this release does
not write but may find: one written before `expires_at` was kept, its data without the key
(absent: the message never expires), and numbers written as JSON integers. Both dialects'
readings of the number (statements.py `{number}`) keep and take the same records."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest

from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, State, Submission
from smtpguard.store import QueuedMessage, Store, store_from_url
from smtpguard.store.postgres import PostgresStore
from smtpguard.store.sqlite import SQLiteStore
from tests.support.stores import empty_store_url

NOW = 1_790_000_000.0
DAY = 86400.0
RETENTION = 30 * DAY
LATER = NOW + RETENTION + 1

ABSENT = object()
EXPIRES: dict[str, Any] = {  # each record's `expires_at`, as its data holds it
    "absent": ABSENT,
    "null": None,
    "integer-later": int(LATER) + 1,
    "integer-now": int(LATER),
    "fraction-later": LATER + 0.25,
    "fraction-earlier": LATER - 0.25,
}
KEPT = {"absent", "null", "integer-later", "fraction-later"}


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    s = store_from_url(await empty_store_url(request, tmp_path))
    await s.open()
    yield s
    await s.close()


def deferred_in_lane(key: str) -> ledger.Record:
    sub = Submission("acme", key, f"fp:{key}", f"att:{key}", "inst-1", None, lane="bulk", max_age=3 * DAY)
    verdict = ledger.decide(None, sub, NOW, LedgerSettings())
    assert isinstance(verdict, ledger.Proceed)
    return replace(verdict.record, state=State.DEFERRED, next_attempt_at=LATER + 60)


def rewritten(data: str, expires: Any) -> str:
    d = json.loads(data)
    if expires is ABSENT:
        del d["expires_at"]
    else:
        d["expires_at"] = expires
    return json.dumps(d, separators=(",", ":"))


def rewrite_expiry(store: Store, key: str, expires: Any) -> None:
    """What an older release or a hand edit left: the record's data, changed in place."""
    if isinstance(store, SQLiteStore):
        with contextlib.closing(sqlite3.connect(store.path)) as c, c:
            (data,) = c.execute("SELECT data FROM events WHERE zone = 'acme' AND key = ?", (key,)).fetchone()
            c.execute(
                "UPDATE events SET data = ? WHERE zone = 'acme' AND key = ?", (rewritten(data, expires), key)
            )
        return
    assert isinstance(store, PostgresStore)
    with psycopg.connect(store.url, autocommit=True) as conn:
        row = conn.execute("SELECT data FROM events WHERE zone = 'acme' AND key = %s", (key,)).fetchone()
        assert row is not None
        conn.execute(
            "UPDATE events SET data = %s WHERE zone = 'acme' AND key = %s", (rewritten(row[0], expires), key)
        )


async def test_a_deferred_record_without_expires_at_never_expires_and_integers_read_as_numbers(
    store: Store,
) -> None:
    message = QueuedMessage("billing@acme.example", ("a@example.com",), b"Subject: x\r\n\r\nx\r\n", 2)
    for key, expires in EXPIRES.items():
        assert await store.enqueue(deferred_in_lane(key), None, message) is None
        rewrite_expiry(store, key, expires)

    assert await store.purge(LATER, RETENTION) == len(EXPIRES) - len(KEPT) == 2
    assert {key for key in EXPIRES if await store.get("acme", key) is not None} == KEPT
    assert {e.key for e in await store.queue_entries("acme")} == KEPT
    assert await store.purge(LATER, RETENTION) == 0
