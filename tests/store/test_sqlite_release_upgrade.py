"""A SQLite file written by an earlier release opens under this one with everything it held
(DESIGN.md §18): the earlier release's own code (its tree from `git archive`, run by this
checkout's interpreter) writes records, a cap unit, a queued message, a suppression, pauses,
counters, an audit entry and a provider event; this release opens the file, read-only first
(the CLI) and then for writing (`serve`), and reads each of them back."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard.policy.ledger import Record, State
from smtpguard.policy.limits import Caps, cap_check
from smtpguard.store import CapUsage, Reserved, Store, store_from_url
from smtpguard.store.base import ZoneAudit
from smtpguard.store.sqlite.migrate import LATEST
from tests.store.test_store_contract import MONTH, NOW, fresh
from tests.support.releases import extract_release

RELEASE = "44f68cc"
"""The last release before the SQLite schema was kept as numbered migrations."""

_WRITE_WITH_THE_RELEASE = r"""
import asyncio, json, sys
from dataclasses import replace
from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, State, Submission
from smtpguard.policy.limits import Caps, cap_check
from smtpguard.store import QueuedMessage, store_from_url
from smtpguard.store.base import StoredEvent, ZoneAudit

NOW = float(sys.argv[2])

def fresh(key, lane=None):
    sub = Submission("acme", key, f"fp:{key}", f"att:{key}", "inst-1", f"<{key}@test>",
                     **({"lane": lane, "max_age": 3 * 86400.0} if lane else {}))
    verdict = ledger.decide(None, sub, NOW, LedgerSettings())
    return verdict.record

async def main():
    s = store_from_url(sys.argv[1])
    await s.open()
    sent = fresh("sent")
    reserved = await s.reserve(sent, None, cap_check("acme", Caps(10, 100), "t-sent", NOW), False)
    assert type(reserved).__name__ == "Reserved"
    done = replace(sent, state=State.DELIVERED, version=sent.version + 1, updated_at=NOW + 1,
                   owner=None, lease_until=None, upstream_id="up-1")
    assert await s.put(done, sent.version) is None
    waiting = replace(fresh("waiting", lane="bulk"), next_attempt_at=NOW + 60)
    body = QueuedMessage("a@acme.test", ("b@x.test",), b"Subject: q\r\n\r\nbody\r\n", 3, True)
    assert await s.enqueue(waiting, None, body) is None
    assert await s.suppress_add("acme", "Gone@X.test", "bounce", NOW)
    await s.set_paused("other", True)
    await s.set_class_paused("acme", "bulk", True)
    await s.add_counts("acme", {"sent": 1, "rejected:cap": 2})
    await s.audit_add("acme", ZoneAudit(NOW, "cli:ops@host", "pause", "", "note"))
    event = StoredEvent(
        NOW + 2, "mailgun", "delivered", "delivered", "b@x.test", "250 ok", "ev-1", "history", NOW + 3
    )
    assert await s.apply_event("acme", "sent", event, None)
    records = {k: (await s.get("acme", k)).to_dict() for k in ("sent", "waiting")}
    await s.close()
    print(json.dumps(records))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def release_tree() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="smtpguard-release-") as tmp:
        yield extract_release(RELEASE, Path(tmp))


def _written_by_the_release(tree: Path, url: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_WITH_THE_RELEASE, url, repr(NOW)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    records: dict[str, Any] = json.loads(done.stdout)
    return records


async def _reads_back(s: Store, written: dict[str, Any]) -> None:
    for key, data in written.items():
        record = await s.get("acme", key)
        assert record is not None and record.to_dict() == data
    sent = await s.get("acme", "sent")
    assert sent is not None and sent.state is State.DELIVERED and sent.upstream_id == "up-1"
    assert [r.key for r in await s.find_records("upstream_id", "up-1")] == ["sent"]
    assert await s.cap_usage("acme", NOW, MONTH) == CapUsage(1, 1)
    entries = await s.queue_entries("acme")
    assert [(e.key, e.lane, e.due_at, e.claimed) for e in entries] == [("waiting", "bulk", NOW + 60, False)]
    assert await s.suppressed("acme", "gone@x.test") == "acme"
    assert [(e.address, e.reason) for e in await s.suppress_list("acme")] == [("gone@x.test", "bounce")]
    assert await s.is_paused("other") and not await s.is_paused("acme")
    assert await s.paused_classes() == {("acme", "bulk")}
    assert await s.counts("acme") == {"sent": 1, "rejected:cap": 2}
    assert await s.audit_log("acme", NOW - 1) == [ZoneAudit(NOW, "cli:ops@host", "pause", "", "note")]
    events = await s.provider_events("acme", "sent")
    assert [(e.source, e.id, e.type, e.received_at) for e in events] == [
        ("mailgun", "ev-1", "delivered", NOW + 3)
    ]
    assert await s.state_counts("acme") == {State.DELIVERED.value: 1, State.QUEUED.value: 1}


def _as_before_counts_and_flag(path: Path) -> None:
    """The file as releases before the state counts and the queued SMTPUTF8 flag left it."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for trigger in ("events_count_insert", "events_count_update", "events_count_delete"):
            conn.execute(f"DROP TRIGGER {trigger}")
        conn.execute("DROP TABLE state_counts")
        conn.execute("ALTER TABLE queue DROP COLUMN smtputf8")
    finally:
        conn.close()


@pytest.mark.parametrize("shape", ["last release", "older release"])
async def test_a_sqlite_file_of_an_earlier_release_opens_and_reads_back(
    release_tree: Path, tmp_path: Path, shape: str
) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    written = _written_by_the_release(release_tree, url)
    assert set(written) == {"sent", "waiting"}
    older = shape == "older release"
    if older:
        _as_before_counts_and_flag(tmp_path / "state.db")

    ro = store_from_url(url, read_only=True, create=False)
    await ro.open()
    try:
        await _reads_back(ro, written)
    finally:
        await ro.close()

    s = store_from_url(url)
    await s.open()
    try:
        await _reads_back(s, written)
        # And it keeps working: the claim gives back the queued body, the caps count on.
        claimed = await s.claim(NOW + 120, [("bulk", 5)], 30.0)
        assert [(c.record.key, c.message.content, c.message.smtputf8) for c in claimed] == [
            ("waiting", b"Subject: q\r\n\r\nbody\r\n", not older)
        ]
        new = fresh("new")
        assert await s.reserve(new, None, cap_check("acme", Caps(10, 100), "t-new", NOW), False) == Reserved()
        assert await s.cap_usage("acme", NOW, MONTH) == CapUsage(2, 2)
        assert await s.state_counts("acme") == {
            State.DELIVERED.value: 1,
            State.QUEUED.value: 1,
            State.IN_FLIGHT.value: 1,
        }
        assert isinstance(await s.get("acme", "new"), Record)
    finally:
        await s.close()

    conn = sqlite3.connect(tmp_path / "state.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == LATEST
    conn.close()

    # Opened again: nothing is lost or counted twice by a second upgrade pass.
    again = store_from_url(url)
    await again.open()
    try:
        assert await again.cap_usage("acme", NOW, MONTH) == CapUsage(2, 2)
        assert sum((await again.state_counts("acme")).values()) == 3
    finally:
        await again.close()
