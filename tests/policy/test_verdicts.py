"""The §19 verdict table, row by row, with no sockets; the scheduling rule; the webhook
events that prove acceptance; and a property over arbitrary logs."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from smtpguard.policy.verdicts import (
    ACCEPTING_EVENTS,
    WINDOW,
    Attempt,
    LogEntry,
    LogKind,
    Verdict,
    VerdictKind,
    due,
    ingested_past,
    log_identity,
    matches,
    next_look,
    proves_acceptance,
    searchable_message_id,
)
from tests.support.verdicts import ABSENT_AFTER as ABSENT
from tests.support.verdicts import GIVE_UP, judged

T0 = 1_700_000_000.0
MIN = 60.0
LOG = log_identity("mailgun", "https://api.mailgun.net", "mg.acme.example", "key-1")
ATTEMPT = Attempt(provider="primary", at=T0, tag="acme:invoice-1044", message_id="<m1@acme.example>", log=LOG)


def judge(entries: list[LogEntry], now: float, proof: bool = False, attempt: Attempt = ATTEMPT) -> Verdict:
    return judged(attempt, entries, now=now, proof=proof, log=LOG)


def entry(kind: LogKind = LogKind.ACCEPTED, **kw: object) -> LogEntry:
    base: dict[str, object] = {
        "provider": "primary",
        "kind": kind,
        "at": T0 + 2,
        "message_id": None,
        "tag": "acme:invoice-1044",
        "upstream_id": "up-1",
    }
    base.update(kw)
    return LogEntry(**base)  # type: ignore[arg-type]


# --- row 1: accepted -----------------------------------------------------------------------
def test_accepted_by_tag_carries_the_logs_upstream_id() -> None:
    v = judge([entry()], now=T0 + 2 * MIN)
    assert v.kind is VerdictKind.ACCEPTED
    assert v.upstream_id == "up-1"
    assert v.settles


def test_accepted_by_message_id_without_angle_brackets() -> None:
    e = entry(tag=None, message_id="m1@acme.example", upstream_id="q-77")
    v = judge([e], now=T0 + 2 * MIN)
    assert (v.kind, v.upstream_id) == (VerdictKind.ACCEPTED, "q-77")


def test_accepted_needs_the_attempts_provider() -> None:
    v = judge([entry(provider="standby")], now=T0 + 2 * MIN)
    assert v.kind is VerdictKind.NONE_YET


def test_accepted_only_within_ten_minutes_of_the_attempt() -> None:
    inside = [entry(at=T0 + WINDOW), entry(at=T0 - WINDOW)]
    for e in inside:
        assert judge([e], now=T0 + 20 * MIN).kind is VerdictKind.ACCEPTED
    for e in (entry(at=T0 + WINDOW + 1), entry(at=T0 - WINDOW - 1)):
        assert judge([e], now=T0 + 20 * MIN).kind is VerdictKind.NONE_YET


def test_another_records_tag_never_matches_even_with_our_message_id() -> None:
    e = entry(tag="other:invoice-9", message_id="<m1@acme.example>")
    assert not matches(ATTEMPT, e)
    assert judge([e], now=T0 + 2 * MIN).kind is VerdictKind.NONE_YET


def test_no_tag_and_no_message_id_matches_nothing() -> None:
    bare = Attempt(provider="primary", at=T0, tag=None, message_id=None)
    assert not matches(bare, entry(tag=None, message_id=None))
    assert not matches(bare, entry(tag="acme:invoice-1044"))


# --- row 2: refused ------------------------------------------------------------------------
def test_refused_at_acceptance_gives_the_logs_reason() -> None:
    e = entry(LogKind.REFUSED, reason="Sandbox subdomains are for test purposes only.")
    v = judge([e], now=T0 + 2 * MIN)
    assert v.kind is VerdictKind.REFUSED
    assert v.reason == "Sandbox subdomains are for test purposes only."


def test_dropped_is_refused_and_names_the_drop_when_the_log_gives_no_reason() -> None:
    v = judge([entry(LogKind.DROPPED, reason="")], now=T0 + 2 * MIN)
    assert (v.kind, v.reason) == (VerdictKind.REFUSED, "dropped")


def test_an_acceptance_wins_over_a_refusal_of_the_same_message() -> None:
    v = judge([entry(LogKind.REFUSED, at=T0 - 60, reason="x"), entry(at=T0 + 1)], now=T0 + 2 * MIN)
    assert v.kind is VerdictKind.ACCEPTED


# --- row 3: not accepted -------------------------------------------------------------------
def test_not_accepted_past_absent_after_with_the_proof() -> None:
    v = judge([], now=T0 + ABSENT, proof=True)
    assert v.kind is VerdictKind.NOT_ACCEPTED
    assert v.settles


def test_not_accepted_never_before_absent_after() -> None:
    assert judge([], now=T0 + ABSENT - 1, proof=True).kind is VerdictKind.NONE_YET


def test_not_accepted_never_without_the_proof() -> None:
    v = judge([], now=T0 + 5 * ABSENT, proof=False)
    assert v.kind is VerdictKind.NONE_YET
    assert not v.settles


def test_the_proof_is_a_later_acceptance_of_another_message_through_the_same_provider() -> None:
    other = entry(tag="acme:invoice-2000", at=T0 + 60)
    assert ingested_past(ATTEMPT, [other])
    assert not ingested_past(ATTEMPT, [entry(tag="acme:invoice-2000", at=T0 - 60)])  # earlier
    assert not ingested_past(ATTEMPT, [entry(tag="acme:invoice-2000", at=T0 + 60, provider="standby")])
    assert not ingested_past(ATTEMPT, [entry(LogKind.DROPPED, tag="acme:invoice-2000", at=T0 + 60)])
    assert not ingested_past(ATTEMPT, [entry(at=T0 + 60)])  # our own message is no proof of absence


# --- row 4: none yet, and give_up ----------------------------------------------------------
def test_nothing_yet_stays_unknown() -> None:
    assert judge([], now=T0 + 2 * MIN).kind is VerdictKind.NONE_YET


def test_past_give_up_absence_never_settles_but_evidence_still_does() -> None:
    late = T0 + GIVE_UP
    assert judge([], now=late, proof=True).kind is VerdictKind.GAVE_UP
    assert judge([entry()], now=late).kind is VerdictKind.ACCEPTED
    assert judge([entry(LogKind.REFUSED)], now=late).kind is VerdictKind.REFUSED


# --- when to look --------------------------------------------------------------------------
def test_first_look_after_then_every_until_give_up() -> None:
    after, every, give_up = 2 * MIN, 5 * MIN, 30 * MIN
    looks: list[float] = []
    last: float | None = None
    for _ in range(100):  # bounded: give_up / every is 6
        at = next_look(T0, last, after=after, every=every, give_up=give_up)
        if at is None:
            break
        looks.append(at - T0)
        last = at
    assert looks == [2 * MIN, 7 * MIN, 12 * MIN, 17 * MIN, 22 * MIN, 27 * MIN]


def test_due_is_false_before_the_first_look_and_past_give_up() -> None:
    kw = {"after": 120.0, "every": 300.0, "give_up": 3600.0}
    assert not due(T0, None, T0 + 119, **kw)
    assert due(T0, None, T0 + 120, **kw)
    assert not due(T0, T0 + 120, T0 + 419, **kw)
    assert due(T0, T0 + 120, T0 + 420, **kw)
    assert not due(T0, T0 + 3500, T0 + 10_000, **kw)


def test_a_look_late_by_a_restart_is_never_earlier_than_after() -> None:
    # A record asked by `smtpguard verdict` at +10 s: the loop still waits for `after`.
    assert next_look(T0, T0 + 10, after=120, every=30, give_up=3600) == T0 + 120


# --- webhook acceptance --------------------------------------------------------------------
def test_webhook_events_that_prove_acceptance() -> None:
    proving = [
        ("mailgun", "accepted"),
        ("mailgun", "delivered"),
        ("sendgrid", "processed"),
        ("sendgrid", "delivered"),
        ("svix", "email.sent"),
        ("svix", "email.delivered"),
        ("postmark", "Delivery"),
        ("ses", "Send"),
        ("ses", "Delivery"),
    ]
    for kind, t in proving:
        assert proves_acceptance(kind, t), (kind, t)
    assert sum(len(v) for v in ACCEPTING_EVENTS.values()) == len(proving)
    not_proving = [
        ("mailgun", "failed"),
        ("mailgun", "rejected"),
        ("sendgrid", "dropped"),
        ("sendgrid", "deferred"),
        ("svix", "email.bounced"),
        ("postmark", "Bounce"),
        ("postmark", "delivery"),
        ("ses", "Bounce"),
        ("ses", "send"),
        ("unknown-kind", "accepted"),
    ]
    for kind, t in not_proving:
        assert not proves_acceptance(kind, t), (kind, t)


# --- property ------------------------------------------------------------------------------
_TAGS = st.sampled_from([None, "acme:invoice-1044", "acme:invoice-2000", "other:x"])
_MIDS = st.sampled_from(
    [None, "<m1@acme.example>", "m1@acme.example", "<m2@acme.example>", "<>", "<m1@acme.example> (c)"]
)
_KINDS = st.sampled_from([None, "mailgun", "sendgrid", "postmark", "svix"])
_entries = st.builds(
    LogEntry,
    provider=st.sampled_from(["primary", "standby"]),
    kind=st.sampled_from(list(LogKind)),
    at=st.floats(T0 - 3600, T0 + 3600, allow_nan=False),
    message_id=_MIDS,
    tag=_TAGS,
    upstream_id=st.sampled_from([None, "up-1", "up-2"]),
    reason=st.sampled_from(["", "blocked"]),
)


@settings(max_examples=300, deadline=None)
@given(
    entries=st.lists(_entries, max_size=8),
    now=st.floats(T0, T0 + 2 * GIVE_UP, allow_nan=False),
    proof=st.booleans(),
    tag=_TAGS,
    mid=_MIDS,
    tagged=_KINDS,
    log=st.sampled_from(["mailgun", "sendgrid", "postmark"]),
    noted=st.sampled_from([None, "this", "another key", "another domain"]),
)
def test_verdicts_rest_on_evidence(
    entries: list[LogEntry],
    now: float,
    proof: bool,
    tag: str | None,
    mid: str | None,
    tagged: str | None,
    log: str,
    noted: str | None,
) -> None:
    asked = log_identity(log, "https://api.example", "mg.acme.example", "key-1")
    noted_log = {
        None: None,
        "this": asked,
        "another key": log_identity(log, "https://api.example", "mg.acme.example", "key-2"),
        "another domain": log_identity(log, "https://api.example", "mg2.acme.example", "key-1"),
    }[noted]
    attempt = Attempt(provider="primary", at=T0, tag=tag, message_id=mid, tagged=tagged, log=noted_log)
    v = judged(attempt, entries, now=now, proof=proof, log=asked)
    mine = [e for e in entries if matches(attempt, e)]
    if v.kind is VerdictKind.ACCEPTED:
        assert v.entry in mine and v.entry is not None and v.entry.kind is LogKind.ACCEPTED
        assert v.upstream_id == v.entry.upstream_id
    if v.kind is VerdictKind.REFUSED:
        assert v.entry in mine and not any(e.kind is LogKind.ACCEPTED for e in mine)
    if v.kind is VerdictKind.NOT_ACCEPTED:
        assert proof and now >= T0 + ABSENT and now < T0 + GIVE_UP and not mine
        # the log was searched by an id the message carried: its tag, or (Mailgun) its
        # Message-ID as Mailgun logs it, and never for a message noted with another log's tag
        searchable = searchable_message_id(mid) is not None
        assert tagged == log or (log == "mailgun" and tagged not in ("sendgrid", "postmark") and searchable)
        assert noted == "this"  # and only the log the provider's api named when it went
    if mine:
        assert v.kind in (VerdictKind.ACCEPTED, VerdictKind.REFUSED)
    for e in mine:  # what matched is this provider's, in the window, and ours
        assert e.provider == "primary" and abs(e.at - T0) <= WINDOW
        assert (e.tag is not None and e.tag == tag) or (
            e.tag is None and searchable_message_id(mid) is not None
        )


def test_a_message_id_field_is_searchable_only_as_one_plain_msg_id() -> None:
    """What Mailgun's log names the message by: the msg-id alone. A field that names no
    message, or holds more than its msg-id, is never searched or matched as written."""
    assert searchable_message_id("<m1@acme.example>") == "m1@acme.example"
    assert searchable_message_id(" m1@acme.example ") == "m1@acme.example"
    for field in (None, "", " ", "<>", "<m1@acme.example> (shop)", "<m1@acme.example> <m2@acme.example>"):
        assert searchable_message_id(field) is None, field


def test_the_policy_imports_only_the_standard_library() -> None:
    """Pure (STYLE.md): no asyncio, no aiohttp, no store, and the clock is a parameter. Of
    smtpguard only policy/ itself, which the same rule holds to (policy.events: the
    Message-ID's bare form)."""
    import smtpguard.policy.verdicts as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    roots = {name.split(".")[0] for name in imported if not name.startswith("smtpguard.policy")}
    assert roots <= sys.stdlib_module_names | {"__future__"}, roots
    assert not roots & {"asyncio", "time", "socket", "threading"}
