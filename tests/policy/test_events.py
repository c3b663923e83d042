"""The pure event model of DESIGN.md §13 (what every source's request is reduced to) and its
effects table, with §18's recipient check: millisecond tests, no I/O. Characterises the rule
exactly, so a move of the model keeps it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import smtpguard.policy.events
import smtpguard.policy.tags
from smtpguard.policy.events import (
    SUPPRESSING,
    Kind,
    Match,
    ProviderEvent,
    StoredEvent,
    bare_message_id,
    content_id,
    effect_of,
    suppression_reason,
)
from smtpguard.policy.senders import recipient_tag

RCPT = "Someone@Example.COM"


def _event(kind: Kind, recipient: str | None = RCPT, status: str = "5.1.1") -> ProviderEvent:
    return ProviderEvent("mg", kind, "failed", recipient, status, 1.0e9, "e1")


def test_the_kinds_are_the_metric_labels() -> None:
    assert [k.value for k in Kind] == [
        "bounce",
        "complaint",
        "unsubscribe",
        "delivered",
        "deferred",
        "soft_bounce",
        "other",
    ]
    assert {Kind.BOUNCE, Kind.COMPLAINT, Kind.UNSUBSCRIBE} == SUPPRESSING


@pytest.mark.parametrize(
    ("kind", "status", "reason"),
    [
        (Kind.BOUNCE, "5.1.1", "bounce 5.1.1 via mg"),
        (Kind.BOUNCE, "", "bounce via mg"),
        (Kind.COMPLAINT, "abuse", "complaint via mg"),
        (Kind.UNSUBSCRIBE, "", "unsubscribe via mg"),
        (Kind.DELIVERED, "250", None),
        (Kind.DEFERRED, "4.2.2", None),
        (Kind.SOFT_BOUNCE, "4.2.2", None),
        (Kind.OTHER, "", None),
    ],
)
def test_the_effects_table(kind: Kind, status: str, reason: str | None) -> None:
    assert suppression_reason(_event(kind, status=status)) == reason


def test_an_event_without_a_recipient_suppresses_nothing() -> None:
    assert suppression_reason(_event(Kind.BOUNCE, recipient=None)) is None
    assert effect_of(_event(Kind.BOUNCE, recipient=None), ()) == (None, "history")


def test_a_suppressing_event_applies_only_to_a_recipient_of_the_message() -> None:
    tags = (recipient_tag("someone@example.com"), recipient_tag("other@example.com"))
    assert effect_of(_event(Kind.BOUNCE), tags) == ("bounce 5.1.1 via mg", "suppressed")
    stranger = (recipient_tag("other@example.com"),)
    assert effect_of(_event(Kind.COMPLAINT), stranger) == (None, "not_a_recipient")


def test_a_record_without_recipient_tags_trusts_its_events() -> None:
    assert effect_of(_event(Kind.UNSUBSCRIBE), ()) == ("unsubscribe via mg", "suppressed")


def test_a_history_only_event_is_history_whoever_it_names() -> None:
    assert effect_of(_event(Kind.DELIVERED), (recipient_tag("other@example.com"),)) == (None, "history")


def test_a_content_id_is_the_same_for_the_same_event_in_any_member_order() -> None:
    one = content_id({"b": 1, "a": [1, "x"]})
    assert one == content_id({"a": [1, "x"], "b": 1})
    assert one == "sha256:a88dede55f330dbae7d6c99cb78c43213f114625"
    assert content_id({"b": 2, "a": [1, "x"]}) != one


@pytest.mark.parametrize(
    ("value", "bare"),
    [("<abc@example.com>", "abc@example.com"), ("  < abc@x > ", "abc@x"), ("abc@x", "abc@x"), ("<>", "")],
)
def test_a_message_id_is_compared_without_its_brackets(value: str, bare: str) -> None:
    assert bare_message_id(value) == bare


def test_a_stored_event_round_trips_through_its_dict() -> None:
    stored = StoredEvent(1.0e9, "mg", "bounce", "failed/permanent", RCPT, "5.1.1", "e1", "suppressed", 1.5e9)
    d = stored.to_dict()
    assert list(d) == [
        "at",
        "source",
        "type",
        "provider_type",
        "recipient",
        "status",
        "id",
        "effect",
        "received_at",
    ]
    assert StoredEvent.from_dict(d) == stored


def test_an_event_matches_nothing_unless_told() -> None:
    assert _event(Kind.OTHER).match == Match((), (), (), ())


@pytest.mark.parametrize("module", [smtpguard.policy.events, smtpguard.policy.tags])
def test_the_model_and_the_tags_import_only_policy_and_the_standard_library(module: object) -> None:
    """Pure (STYLE.md): the stores import the model, so it must import nothing above them."""
    tree = ast.parse(Path(str(getattr(module, "__file__", ""))).read_text())
    imported = {
        # `from smtpguard import replies` names the module it imports, not the package.
        (f"smtpguard.{alias.name}" if node.module == "smtpguard" else node.module or "")
        if isinstance(node, ast.ImportFrom)
        else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    ours = {name for name in imported if name.split(".")[0] == "smtpguard"}
    assert all(name.startswith("smtpguard.policy.") or name == "smtpguard.replies" for name in ours), ours
    roots = {name.split(".")[0] for name in imported - ours}
    assert roots <= sys.stdlib_module_names | {"__future__"}, roots
    assert not roots & {"asyncio", "time", "socket", "threading"}
