"""The ledger record's stored shape (DESIGN.md §4): the dict every store persists, pinned key by
key so that moving Record/Attempt between modules cannot change what is written or read back."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from smtpguard.policy import ledger, record
from smtpguard.policy.ledger import Attempt, AuditEntry, Phase, Record, State
from smtpguard.replies import Reply

T0 = 1_700_000_000.0

FULL = Record(
    zone="acme",
    key="invoice:acme:1044",
    state=State.UNKNOWN,
    fingerprint="f" * 64,
    created_at=T0,
    updated_at=T0 + 5,
    version=7,
    sg_id="A2",
    owner="i-1",
    lease_until=T0 + 30,
    phase=Phase.DATA_SENT,
    next_attempt_at=T0 + 60,
    reply=Reply(451, "4.3.0", "later"),
    upstream_id="Q7",
    message_id="<m@app>",
    valid_until=T0 + 600,
    lane="bulk",
    queue_id="QID1",
    expires_at=T0 + 3600,
    lost_owner="i-1",
    lost_until=T0 + 180,
    sender="app@acme.example",
    via="primary",
    rcpt_tags=("t1", "t2"),
    username="alice",
    unrefunded=("tok1",),
    attempts=(
        Attempt(
            "A2",
            T0 + 1,
            "i-1",
            "primary",
            "data_sent",
            "unknown",
            code=None,
            rejected=(("bob@example.org", Reply(550, "5.1.1", "no such user")),),
        ),
    ),
    audit=(AuditEntry(T0 + 2, "ops", "release", "failed", "deferred", "cause fixed"),),
)

FULL_DICT = {
    "zone": "acme",
    "key": "invoice:acme:1044",
    "state": "unknown",
    "fingerprint": "f" * 64,
    "created_at": T0,
    "updated_at": T0 + 5,
    "version": 7,
    "sg_id": "A2",
    "owner": "i-1",
    "lease_until": T0 + 30,
    "phase": "data_sent",
    "next_attempt_at": T0 + 60,
    "reply": {"code": 451, "enhanced": "4.3.0", "text": "later"},
    "upstream_id": "Q7",
    "message_id": "<m@app>",
    "valid_until": T0 + 600,
    "lane": "bulk",
    "queue_id": "QID1",
    "expires_at": T0 + 3600,
    "lost_owner": "i-1",
    "lost_until": T0 + 180,
    "rcpt_tags": ["t1", "t2"],
    "unrefunded": ["tok1"],
    "username": "alice",
    "attempts": [
        {
            "attempt_id": "A2",
            "at": T0 + 1,
            "instance": "i-1",
            "provider": "primary",
            "phase": "data_sent",
            "outcome": "unknown",
            "code": None,
            "enhanced": "",
            "text": "",
            "upstream_id": None,
            "message_id": None,
            "rejected": [["bob@example.org", {"code": 550, "enhanced": "5.1.1", "text": "no such user"}]],
        }
    ],
    "via": "primary",
    "sender": "app@acme.example",
    "audit": [
        {
            "at": T0 + 2,
            "actor": "ops",
            "action": "release",
            "from_state": "failed",
            "to_state": "deferred",
            "note": "cause fixed",
        }
    ],
}


def test_to_dict_is_the_stored_shape_key_for_key_and_in_order() -> None:
    d = FULL.to_dict()
    assert d == FULL_DICT
    assert list(d) == list(FULL_DICT)
    assert Record.from_dict(json.loads(json.dumps(d))) == FULL


def test_via_and_sender_are_left_out_when_unset() -> None:
    # Records written before §18 had neither key; a record without them stays byte-identical.
    plain = ledger.evolve(FULL, via=None, sender=None)
    d = plain.to_dict()
    assert "via" not in d and "sender" not in d
    assert Record.from_dict(d) == plain


def test_from_dict_reads_a_record_written_before_the_later_fields() -> None:
    later = ("rcpt_tags", "unrefunded", "username", "via", "sender")
    old = json.loads(json.dumps({k: v for k, v in FULL_DICT.items() if k not in later}))
    for a in old["attempts"]:
        del a["rejected"]
    got = Record.from_dict(old)
    assert got.rcpt_tags == () and got.unrefunded == () and got.username is None
    assert got.via is None and got.sender is None and got.attempts[0].rejected == ()


def test_evolve_refuses_a_name_that_is_not_a_field() -> None:
    with pytest.raises(TypeError, match="no field stat"):
        ledger.evolve(FULL, stat=State.DELIVERED)
    assert ledger.evolve(FULL, version=8).version == 8 and FULL.version == 7


def test_the_ledger_re_exports_the_record_names_as_the_same_objects() -> None:
    # Stores, the CLI, tests and bench/ import these from the ledger; a copy instead of the
    # same class would make isinstance and `is State.X` checks fail across the two paths.
    for name in ("State", "Phase", "Attempt", "AuditEntry", "Record", "evolve"):
        assert getattr(ledger, name) is getattr(record, name), name


def test_record_module_stays_pure_and_below_the_ledger() -> None:
    # policy imports only replies and other policy modules; record.py must not import the
    # ledger (which imports it), or the two would form a cycle.
    tree = ast.parse(Path(record.__file__).read_text())
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("__")
    } | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    ours = {m for m in imported if m.startswith("smtpguard")}
    assert ours == {"smtpguard.replies"}
    assert imported - ours <= {"dataclasses", "enum", "typing"}
