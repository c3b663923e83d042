"""The event ledger as a table (DESIGN.md §3 ledger rows, §4): no store, no sockets, clock = a number."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from smtpguard import replies
from smtpguard.policy import ledger
from smtpguard.policy.ledger import (
    Answer,
    Attempt,
    AuditEntry,
    LedgerSettings,
    OperatorRefused,
    Phase,
    Proceed,
    Record,
    State,
    Submission,
    Transition,
    Wait,
)
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.replies import Reply

S = LedgerSettings(min_retry_interval=60.0, lease=30.0, derive_window=600.0)
T0 = 1_700_000_000.0
FP = "f" * 64
OTHER_FP = "0" * 64
KEY = "invoice:acme:1044"
FAILED_REPLY = Reply(550, "5.1.1", "[sg:A1] <bob@example.org>: Recipient address rejected")


def sub(**kw: Any) -> Submission:
    base: dict[str, Any] = {
        "zone": "acme",
        "key": KEY,
        "fingerprint": FP,
        "attempt_id": "A2",
        "instance": "i-2",
        "message_id": "<m2@app>",
    }
    base.update(kw)
    return Submission(**base)


def rec(state: State, **kw: Any) -> Record:
    base: dict[str, Any] = {
        "zone": "acme",
        "key": KEY,
        "state": state,
        "fingerprint": FP,
        "created_at": T0,
        "updated_at": T0,
        "version": 3,
        "sg_id": "A1",
    }
    if state is State.IN_FLIGHT:
        base.update(owner="i-1", lease_until=T0 + 30, phase=Phase.BEFORE_DATA)
    base.update(kw)
    return Record(**base)


def attempt(attempt_id: str = "A1", **kw: Any) -> Attempt:
    base: dict[str, Any] = {
        "attempt_id": attempt_id,
        "at": T0,
        "instance": "i-1",
        "provider": "primary",
        "phase": "data_sent",
        "outcome": "deferred",
        "code": 451,
        "enhanced": "4.3.0",
        "text": "try later",
    }
    base.update(kw)
    return Attempt(**base)


def owned(phase: Phase = Phase.BEFORE_DATA, attempt_id: str = "A1") -> Record:
    return rec(State.IN_FLIGHT, sg_id=attempt_id, phase=phase, version=1)


# --- decide(): the rows that answer at once ----------------------------------------------------
ANSWER_ROWS = [
    pytest.param(
        rec(State.DELIVERED, fingerprint=OTHER_FP),
        T0 + 5,
        (550, "5.7.0"),
        "reused",
        ("reused", KEY),
        id="different-fingerprint-reused",
    ),
    pytest.param(
        rec(State.DELIVERED, upstream_id="4BQ9Zx0QxFz1", sg_id="SG-ORIG"),
        T0 + 5,
        (250, "2.0.0"),
        "duplicate",
        ("duplicate", "[sg:SG-ORIG]", "4BQ9Zx0QxFz1", KEY),
        id="delivered-duplicate-carries-ids",
    ),
    pytest.param(
        rec(State.DELIVERED, sg_id="SG-ORIG", upstream_id=None),
        T0 + 5,
        (250, "2.0.0"),
        "duplicate",
        ("duplicate", "[sg:SG-ORIG]"),
        id="delivered-duplicate-without-upstream-id",
    ),
    pytest.param(
        rec(State.QUEUED, sg_id="SG-Q"),
        T0 + 5,
        (250, "2.0.0"),
        "duplicate",
        ("duplicate", "[sg:SG-Q]", "queued"),
        id="queued-duplicate",
    ),
    pytest.param(
        rec(State.DEFERRED, next_attempt_at=T0 + 60),
        T0 + 59,
        (451, "4.7.1"),
        "too_soon",
        ("2023-11-14T22:14:20Z", KEY),
        id="deferred-before-next-attempt-names-time",
    ),
    pytest.param(
        rec(State.FAILED, reply=FAILED_REPLY),
        T0 + 86400,
        (550, "5.1.1"),
        "failed_held",
        ("Recipient address rejected",),
        id="failed-repeats-stored-5xx",
    ),
    pytest.param(
        rec(State.UNKNOWN),
        T0 + 86400,
        (451, "4.3.0"),
        "unknown_held",
        ("unknown", KEY),
        id="unknown-held",
    ),
    pytest.param(
        rec(State.EXPIRED),
        T0 + 5,
        (550, "5.4.7"),
        "expired",
        ("expired", KEY),
        id="expired",
    ),
]


@pytest.mark.parametrize(("existing", "now", "code", "decision", "words"), ANSWER_ROWS)
def test_decide_answers(
    existing: Record, now: float, code: tuple[int, str], decision: str, words: tuple[str, ...]
) -> None:
    verdict = ledger.decide(existing, sub(), now, S)
    assert isinstance(verdict, Answer)
    assert (verdict.reply.code, verdict.reply.enhanced) == code
    assert verdict.decision == decision
    for word in words:
        assert word in verdict.reply.text


def test_failed_reply_is_the_stored_one_exactly() -> None:
    verdict = ledger.decide(rec(State.FAILED, reply=FAILED_REPLY), sub(), T0 + 1, S)
    assert isinstance(verdict, Answer)
    assert verdict.reply == FAILED_REPLY


def test_deferred_reply_names_next_attempt_time() -> None:
    verdict = ledger.decide(rec(State.DEFERRED, next_attempt_at=T0 + 60), sub(), T0 + 10, S)
    assert isinstance(verdict, Answer)
    assert verdict.reply == replies.retry_too_soon(KEY, T0 + 60)


# --- decide(): reserve a new attempt -----------------------------------------------------------
def test_absent_key_proceeds_with_a_fresh_in_flight_record() -> None:
    verdict = ledger.decide(None, sub(), T0, S)
    assert isinstance(verdict, Proceed)
    assert verdict.expected_version is None
    r = verdict.record
    assert r.state is State.IN_FLIGHT
    assert r.phase is Phase.BEFORE_DATA
    assert r.lease_until == T0 + S.lease
    assert r.owner == "i-2"
    assert r.sg_id == "A2"
    assert (r.zone, r.key, r.fingerprint) == ("acme", KEY, FP)
    assert (r.created_at, r.updated_at, r.version) == (T0, T0, 1)
    assert r.message_id == "<m2@app>"
    assert r.valid_until is None
    assert r.attempts == () and r.audit == ()


def test_absent_derived_key_gets_a_validity_window() -> None:
    verdict = ledger.decide(None, sub(key="auto:" + FP, derived=True), T0, S)
    assert isinstance(verdict, Proceed)
    assert verdict.record.valid_until == T0 + S.derive_window


@pytest.mark.parametrize(
    "now",
    [pytest.param(T0 + 600, id="at-valid-until"), pytest.param(T0 + 3600, id="well-past")],
)
def test_derived_key_past_valid_until_is_replaced(now: float) -> None:
    old = rec(
        State.DELIVERED,
        key="auto:" + FP,
        valid_until=T0 + 600,
        version=4,
        attempts=(attempt(outcome="delivered", code=250),),
    )
    verdict = ledger.decide(old, sub(key="auto:" + FP, derived=True), now, S)
    assert isinstance(verdict, Proceed)
    assert verdict.expected_version == 4
    r = verdict.record
    assert r.state is State.IN_FLIGHT and r.phase is Phase.BEFORE_DATA
    assert r.version == 5
    assert r.created_at == now and r.lease_until == now + S.lease
    assert r.valid_until == now + S.derive_window
    # The old event's history stays with the key; the new event starts with a note of it.
    assert r.sg_id == "A2" and r.attempts == old.attempts
    assert r.audit[-1].action == "new_event" and "sg:A1" in r.audit[-1].note


@pytest.mark.parametrize("state", [State.UNKNOWN, State.FAILED])
def test_derived_key_past_valid_until_never_replaces_a_held_event(state: State) -> None:
    # DESIGN.md §11.1: replacing an unknown or failed record would resend what an operator
    # must decide on; after the window it is answered by its own row, as within it.
    held = rec(state, key="auto:" + FP, valid_until=T0 + 600, reply=Reply(550, "5.1.1", "no such user"))
    verdict = ledger.decide(held, sub(key="auto:" + FP, derived=True), T0 + 3600, S)
    assert isinstance(verdict, Answer)
    assert verdict.decision == {"unknown": "unknown_held", "failed": "failed_held"}[state.value]
    assert verdict.reply.code == (451 if state is State.UNKNOWN else 550)


@pytest.mark.parametrize("state", [State.QUEUED, State.DEFERRED])
def test_derived_key_past_valid_until_in_a_lane_is_a_queued_duplicate(state: State) -> None:
    # Its message waits in a lane and a worker sends it: a replacement would be a second copy.
    waiting = rec(state, key="auto:" + FP, valid_until=T0 + 600, lane="bulk", queue_id="Q1")
    verdict = ledger.decide(waiting, sub(key="auto:" + FP, derived=True), T0 + 3600, S)
    assert isinstance(verdict, Answer) and verdict.decision == "duplicate"


def test_relay_deferred_retried_in_queue_mode_is_taken_into_the_lane() -> None:
    # The zone moved from relay to queue between two attempts (DESIGN.md §4a).
    deferred = rec(State.DEFERRED, next_attempt_at=T0 + 60, version=3)
    verdict = ledger.decide(deferred, sub(lane="transactional", max_age=3600.0), T0 + 61, S)
    assert isinstance(verdict, Proceed) and verdict.expected_version == 3
    r = verdict.record
    assert r.state is State.QUEUED and r.lane == "transactional"
    assert r.queue_id == "A2" and r.sg_id == "A2"
    assert r.owner is None and r.lease_until is None and r.phase is None
    assert r.next_attempt_at == T0 + 61 and r.expires_at == T0 + 61 + 3600


def test_takeover_before_data_refunds_the_abandoned_unit() -> None:
    dead = rec(State.IN_FLIGHT, lease_until=T0 + 30, phase=Phase.BEFORE_DATA)
    verdict = ledger.decide(dead, sub(), T0 + 31, S)
    assert isinstance(verdict, Proceed) and verdict.refund == ("A1",)
    deferred = rec(State.DEFERRED, next_attempt_at=T0)
    again = ledger.decide(deferred, sub(), T0 + 1, S)
    assert isinstance(again, Proceed) and again.refund == ()


def test_a_takeover_that_dies_before_its_refunds_leaves_them_to_the_next() -> None:
    # Worker 1 consumed a unit and died; worker 2 took the entry over and died before its
    # refund landed; worker 3 must give back both.
    first = rec(State.IN_FLIGHT, lease_until=T0 + 30, phase=Phase.BEFORE_DATA, sg_id="X1", lane="bulk")
    second = ledger.on_claim(first, "X2", "w2", T0 + 31, S)
    assert isinstance(second, ledger.Deliver) and second.refund == ("X1",)
    third = ledger.on_claim(second.record, "X3", "w3", T0 + 31 + S.lease, S)
    assert isinstance(third, ledger.Deliver) and third.refund == ("X1", "X2")
    done = ledger.settle(
        third.record, "X3", "w3", Outcome(Kind.DELIVERED, "p", Reply(250, "2.0.0", "ok")), T0 + 70, S
    )
    assert done.unrefunded == ()


def test_lost_lease_after_dot_keeps_when_its_owner_may_still_send() -> None:
    s = ledger.LedgerSettings(send_timeout=150.0)
    dead = rec(State.IN_FLIGHT, lease_until=T0 + 30, phase=Phase.DATA_SENT, owner="i-1")
    verdict = ledger.decide(dead, sub(), T0 + 31, s)
    assert isinstance(verdict, ledger.Transition)
    lost = verdict.record
    assert lost.state is State.UNKNOWN and lost.lost_owner == "i-1"
    assert lost.lost_until == T0 + 31 + 150.0
    with pytest.raises(ledger.RetryTooEarly) as refused:
        ledger.resolve(lost, "retry", "cli:alice", T0 + 100)
    assert "i-1" in str(refused.value) and "--force" in str(refused.value)
    forced = ledger.resolve(lost, "retry", "cli:alice", T0 + 100, force=True)
    assert forced.state is State.DEFERRED and "forced" in forced.audit[-1].note
    later = ledger.resolve(lost, "retry", "cli:alice", T0 + 181.0)
    assert later.state is State.DEFERRED and later.lost_until is None
    # delivered is always allowed: it sends nothing.
    assert ledger.resolve(lost, "delivered", "cli:alice", T0 + 100).state is State.DELIVERED


@pytest.mark.parametrize("phase", [Phase.BEFORE_DATA, Phase.DATA_SENT])
def test_derived_key_past_valid_until_still_on_the_wire_waits(phase: Phase) -> None:
    # derive_window shorter than a slow DATA: the attempt holds a live lease past the window.
    on_wire = rec(State.IN_FLIGHT, key="auto:" + FP, valid_until=T0 + 20, lease_until=T0 + 50, phase=phase)
    verdict = ledger.decide(on_wire, sub(key="auto:" + FP, derived=True), T0 + 40, S)
    assert isinstance(verdict, Wait)


def test_derived_key_within_valid_until_is_a_duplicate() -> None:
    old = rec(State.DELIVERED, key="auto:" + FP, valid_until=T0 + 600)
    verdict = ledger.decide(old, sub(key="auto:" + FP, derived=True), T0 + 599, S)
    assert isinstance(verdict, Answer)
    assert (verdict.reply.code, verdict.decision) == (250, "duplicate")


@pytest.mark.parametrize(
    ("lease_until", "now"),
    [
        pytest.param(T0 + 30, T0 + 1, id="lease-live"),
        pytest.param(T0 + 30, T0 + 29.999, id="lease-live-last-ms"),
    ],
)
@pytest.mark.parametrize("phase", [Phase.BEFORE_DATA, Phase.DATA_SENT])
def test_in_flight_with_live_lease_waits(lease_until: float, now: float, phase: Phase) -> None:
    verdict = ledger.decide(rec(State.IN_FLIGHT, lease_until=lease_until, phase=phase), sub(), now, S)
    assert isinstance(verdict, Wait)


@pytest.mark.parametrize(
    "now", [pytest.param(T0 + 30, id="at-lease-end"), pytest.param(T0 + 500, id="long-after")]
)
def test_expired_lease_before_data_is_retried(now: float) -> None:
    prior = (attempt("A0", outcome="deferred"),)
    existing = rec(State.IN_FLIGHT, attempts=prior, version=7, message_id="<m1@app>")
    verdict = ledger.decide(existing, sub(), now, S)
    assert isinstance(verdict, Proceed)
    assert verdict.expected_version == 7
    r = verdict.record
    assert r.state is State.IN_FLIGHT and r.phase is Phase.BEFORE_DATA
    assert r.sg_id == "A2" and r.owner == "i-2"
    assert r.lease_until == now + S.lease
    assert r.version == 8 and r.updated_at == now and r.created_at == T0
    assert r.attempts == prior
    assert r.message_id == "<m2@app>"


def test_retry_keeps_the_stored_message_id_when_the_client_sent_none() -> None:
    existing = rec(State.DEFERRED, next_attempt_at=T0, message_id="<m1@app>")
    verdict = ledger.decide(existing, sub(message_id=None), T0 + 1, S)
    assert isinstance(verdict, Proceed)
    assert verdict.record.message_id == "<m1@app>"


def test_expired_lease_after_data_becomes_unknown() -> None:
    existing = rec(State.IN_FLIGHT, phase=Phase.DATA_SENT, owner="i-1", version=5)
    verdict = ledger.decide(existing, sub(), T0 + 31, S)
    assert isinstance(verdict, Transition)
    assert verdict.expected_version == 5
    assert (verdict.reply.code, verdict.reply.enhanced) == (451, "4.3.0")
    assert verdict.decision == "unknown_held"
    r = verdict.record
    assert r.state is State.UNKNOWN
    assert r.owner is None and r.lease_until is None
    assert r.version == 6 and r.updated_at == T0 + 31
    assert r.sg_id == "A1", "the lost attempt stays the record's attempt"
    (entry,) = r.audit
    assert (entry.at, entry.actor, entry.action) == (T0 + 31, "smtpguard", "lease_expired")
    assert (entry.from_state, entry.to_state) == ("in_flight", "unknown")
    assert "i-1" in entry.note


def test_in_flight_without_lease_is_treated_as_expired() -> None:
    verdict = ledger.decide(rec(State.IN_FLIGHT, lease_until=None), sub(), T0, S)
    assert isinstance(verdict, Proceed)


@pytest.mark.parametrize(
    ("next_attempt_at", "now"),
    [
        pytest.param(T0 + 60, T0 + 60, id="exactly-at"),
        pytest.param(T0 + 60, T0 + 61, id="after"),
        pytest.param(None, T0, id="no-time-set"),
    ],
)
def test_deferred_after_next_attempt_proceeds(next_attempt_at: float | None, now: float) -> None:
    prior = (attempt("A1"),)
    existing = rec(
        State.DEFERRED,
        next_attempt_at=next_attempt_at,
        attempts=prior,
        reply=Reply(451, "4.3.0", "later"),
    )
    verdict = ledger.decide(existing, sub(), now, S)
    assert isinstance(verdict, Proceed)
    assert verdict.expected_version == 3
    r = verdict.record
    assert r.state is State.IN_FLIGHT and r.phase is Phase.BEFORE_DATA
    assert r.next_attempt_at is None
    assert r.sg_id == "A2" and r.attempts == prior and r.version == 4


def test_reused_is_checked_before_any_state() -> None:
    for state in State:
        verdict = ledger.decide(rec(state, fingerprint=OTHER_FP), sub(), T0 + 1, S)
        assert isinstance(verdict, Answer), state
        assert (verdict.reply.code, verdict.reply.enhanced, verdict.decision) == (550, "5.7.0", "reused")


# --- the owner's writes ------------------------------------------------------------------------
def test_mark_data_sent_sets_phase_and_renews_lease() -> None:
    new = ledger.mark_data_sent(owned(), "A1", T0 + 10, S)
    assert new is not None
    assert new.phase is Phase.DATA_SENT
    assert new.lease_until == T0 + 10 + S.lease
    assert (new.version, new.updated_at) == (2, T0 + 10)


def test_the_data_sent_note_says_which_tag_went_and_the_next_attempt_forgets_it() -> None:
    """Record.tagged: whether a log searched by its tag can prove the message absent."""
    noted = ledger.mark_data_sent(owned(), "A1", T0 + 10, S, "primary", "sendgrid")
    assert noted is not None and (noted.via, noted.tagged) == ("primary", "sendgrid")
    assert Record.from_dict(json.loads(json.dumps(noted.to_dict()))).tagged == "sendgrid"
    # Noted by the previous release, which writes no such member: not known to be tagged.
    written_before = {k: v for k, v in noted.to_dict().items() if k != "tagged"}
    assert Record.from_dict(written_before).tagged is None
    plain = ledger.mark_data_sent(owned(), "A1", T0 + 10, S, "primary")  # a provider that tags nothing
    assert plain is not None and "tagged" not in plain.to_dict()
    unknown = ledger.settle(noted, "A1", "i-1", UNKNOWN, T0 + 11, S)
    assert (unknown.state, unknown.tagged) == (State.UNKNOWN, "sendgrid")
    deferred = ledger.settle(noted, "A1", "i-1", DEFERRED, T0 + 11, S)
    retry = ledger.decide(deferred, sub(attempt_id="A2"), T0 + 80, S)
    assert isinstance(retry, Proceed) and (retry.record.via, retry.record.tagged) == (None, None)


@pytest.mark.parametrize(
    "current",
    [
        pytest.param(owned(attempt_id="A9"), id="taken-over"),
        pytest.param(rec(State.DELIVERED, sg_id="A1"), id="already-settled"),
        pytest.param(rec(State.UNKNOWN, sg_id="A1"), id="declared-unknown"),
    ],
)
def test_writes_by_a_non_owner_are_refused(current: Record) -> None:
    assert ledger.mark_data_sent(current, "A1", T0 + 1, S) is None
    assert ledger.renew_lease(current, "A1", T0 + 1, S) is None


def test_renew_lease_extends_only_the_lease() -> None:
    current = owned(Phase.DATA_SENT)
    new = ledger.renew_lease(current, "A1", T0 + 25, S)
    assert new is not None
    assert new.lease_until == T0 + 25 + S.lease
    assert new.phase is Phase.DATA_SENT and new.state is State.IN_FLIGHT
    assert new.version == current.version + 1


# --- settle() ----------------------------------------------------------------------------------
DELIVERED = Outcome(Kind.DELIVERED, "primary", Reply(250, "2.0.0", "Ok: queued as Q1"), upstream_id="Q1")
DEFERRED = Outcome(Kind.DEFERRED, "primary", Reply(451, "4.3.0", "Try again later"))
FAILED = Outcome(Kind.FAILED, "primary", Reply(550, "5.1.1", "User unknown"))
UNKNOWN = Outcome(Kind.UNKNOWN, "primary", detail="after DATA: TimeoutError")
UNAVAILABLE = Outcome(Kind.UNAVAILABLE, None, detail="every provider circuit is open")

SETTLE_ROWS = [
    pytest.param(DELIVERED, State.DELIVERED, DELIVERED.reply, None, "Q1", id="delivered"),
    pytest.param(DEFERRED, State.DEFERRED, DEFERRED.reply, T0 + 100 + 60, None, id="deferred"),
    pytest.param(FAILED, State.FAILED, FAILED.reply, None, None, id="failed"),
    pytest.param(UNKNOWN, State.UNKNOWN, None, None, None, id="unknown"),
    pytest.param(UNAVAILABLE, State.DEFERRED, replies.no_provider(), T0 + 100, None, id="unavailable"),
]


@pytest.mark.parametrize(("outcome", "state", "reply", "next_at", "upstream_id"), SETTLE_ROWS)
def test_settle_by_owner(
    outcome: Outcome, state: State, reply: Reply | None, next_at: float | None, upstream_id: str | None
) -> None:
    current = owned(Phase.DATA_SENT)
    new = ledger.settle(current, "A1", "i-1", outcome, T0 + 100, S, message_id="<m1@app>")
    assert new.state is state
    assert new.reply == reply
    assert new.next_attempt_at == next_at
    assert new.upstream_id == upstream_id
    assert (new.owner, new.lease_until, new.phase) == (None, None, None)
    assert (new.version, new.updated_at) == (current.version + 1, T0 + 100)
    assert new.sg_id == "A1"
    (a,) = new.attempts
    assert (a.attempt_id, a.at, a.instance, a.provider) == ("A1", T0 + 100, "i-1", outcome.provider)
    assert a.outcome == outcome.kind.value
    assert a.phase == "data_sent"
    assert a.message_id == "<m1@app>"
    assert a.upstream_id == outcome.upstream_id
    if outcome.reply:
        assert (a.code, a.enhanced, a.text) == (
            outcome.reply.code,
            outcome.reply.enhanced,
            outcome.reply.text,
        )
    else:
        assert (a.code, a.enhanced, a.text) == (None, "", outcome.detail)


def test_unavailable_is_retryable_at_once_with_451_441() -> None:
    new = ledger.settle(owned(), "A1", "i-1", UNAVAILABLE, T0 + 5, S)
    assert new.reply is not None
    assert (new.reply.code, new.reply.enhanced) == (451, "4.4.1")
    again = ledger.decide(new, sub(), T0 + 5, S)
    assert isinstance(again, Proceed)


def test_deferred_then_too_soon_then_retry() -> None:
    new = ledger.settle(owned(), "A1", "i-1", DEFERRED, T0 + 5, S)
    too_soon = ledger.decide(new, sub(), T0 + 64, S)
    assert isinstance(too_soon, Answer) and too_soon.reply.code == 451
    assert isinstance(ledger.decide(new, sub(), T0 + 65, S), Proceed)


@pytest.mark.parametrize(
    "outcome",
    [pytest.param(o, id=o.kind.value) for o in (DELIVERED, DEFERRED, FAILED, UNKNOWN, UNAVAILABLE)],
)
def test_settle_is_idempotent_per_attempt(outcome: Outcome) -> None:
    once = ledger.settle(owned(), "A1", "i-1", outcome, T0 + 5, S)
    twice = ledger.settle(once, "A1", "i-1", outcome, T0 + 9, S)
    assert twice is once
    # Even a different outcome reported for the same attempt does not rewrite history.
    assert ledger.settle(once, "A1", "i-1", DELIVERED, T0 + 9, S) is once


@pytest.mark.parametrize(
    "outcome",
    [pytest.param(o, id=o.kind.value) for o in (DEFERRED, FAILED, UNKNOWN, UNAVAILABLE)],
)
def test_settle_after_takeover_only_appends_the_attempt(outcome: Outcome) -> None:
    taken = owned(attempt_id="A9")
    new = ledger.settle(taken, "A1", "i-1", outcome, T0 + 40, S)
    assert new.state is State.IN_FLIGHT
    assert (new.sg_id, new.owner, new.lease_until) == ("A9", taken.owner, taken.lease_until)
    assert new.version == taken.version + 1
    (a,) = new.attempts
    assert a.attempt_id == "A1" and a.outcome == outcome.kind.value
    assert a.phase == "before_data"


def test_settle_after_takeover_a_delivery_still_wins() -> None:
    taken = owned(attempt_id="A9")
    new = ledger.settle(taken, "A1", "i-1", DELIVERED, T0 + 40, S)
    assert new.state is State.DELIVERED
    assert new.sg_id == "A1" and new.upstream_id == "Q1"
    assert (new.owner, new.lease_until, new.phase) == (None, None, None)
    assert [a.attempt_id for a in new.attempts] == ["A1"]
    # The new owner can no longer write, and the next submission is a duplicate.
    assert ledger.mark_data_sent(new, "A9", T0 + 41, S) is None
    verdict = ledger.decide(new, sub(attempt_id="A10"), T0 + 42, S)
    assert isinstance(verdict, Answer) and verdict.decision == "duplicate"
    assert "[sg:A1]" in verdict.reply.text and "Q1" in verdict.reply.text


def test_settle_after_unknown_delivery_wins() -> None:
    lost = replace(owned(Phase.DATA_SENT), state=State.UNKNOWN, owner=None, lease_until=None)
    new = ledger.settle(lost, "A1", "i-1", DELIVERED, T0 + 40, S)
    assert new.state is State.DELIVERED and new.upstream_id == "Q1"


def test_settle_appends_after_prior_attempts() -> None:
    prior = (attempt("A0"),)
    current = replace(owned(), attempts=prior)
    new = ledger.settle(current, "A1", "i-1", DELIVERED, T0 + 5, S)
    assert [a.attempt_id for a in new.attempts] == ["A0", "A1"]


def test_settle_keeps_rejected_recipients() -> None:
    refused = (("bob@example.org", Reply(550, "5.1.1", "no such user")),)
    partial = replace(DELIVERED, rejected=refused, accepted=("ann@example.org",))
    new = ledger.settle(owned(), "A1", "i-1", partial, T0 + 5, S)
    assert new.attempts[0].rejected == refused


# --- operator decisions ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("as_", "state", "next_at"),
    [
        pytest.param("delivered", State.DELIVERED, None, id="as-delivered"),
        pytest.param("retry", State.DEFERRED, T0 + 500, id="as-retry"),
    ],
)
def test_resolve_unknown(as_: str, state: State, next_at: float | None) -> None:
    unknown = rec(State.UNKNOWN, version=4)
    new = ledger.resolve(unknown, as_, "ops@acme", T0 + 500)
    assert new.state is state
    assert new.next_attempt_at == next_at
    assert (new.version, new.updated_at) == (5, T0 + 500)
    (entry,) = new.audit
    assert entry == AuditEntry(T0 + 500, "ops@acme", f"resolve:{as_}", "unknown", state.value)


def test_resolve_as_retry_lets_the_next_submission_proceed() -> None:
    new = ledger.resolve(rec(State.UNKNOWN), "retry", "ops", T0 + 500)
    assert isinstance(ledger.decide(new, sub(), T0 + 500, S), Proceed)


def test_resolve_as_delivered_makes_the_next_submission_a_duplicate() -> None:
    new = ledger.resolve(rec(State.UNKNOWN), "delivered", "ops", T0 + 500)
    verdict = ledger.decide(new, sub(), T0 + 501, S)
    assert isinstance(verdict, Answer) and verdict.reply.code == 250 and verdict.decision == "duplicate"


@pytest.mark.parametrize("state", [s for s in State if s is not State.UNKNOWN], ids=str)
def test_resolve_refused_unless_unknown(state: State) -> None:
    with pytest.raises(OperatorRefused, match="not unknown"):
        ledger.resolve(rec(state), "retry", "ops", T0)


def test_second_resolve_is_refused() -> None:
    once = ledger.resolve(rec(State.UNKNOWN), "delivered", "ops", T0 + 1)
    with pytest.raises(OperatorRefused):
        ledger.resolve(once, "delivered", "ops", T0 + 2)


def test_resolve_with_an_unknown_verdict_is_refused() -> None:
    with pytest.raises(OperatorRefused, match="delivered or retry"):
        ledger.resolve(rec(State.UNKNOWN), "sent", "ops", T0)


def test_release_failed() -> None:
    failed = rec(State.FAILED, reply=FAILED_REPLY, version=6)
    new = ledger.release(failed, "ops@acme", T0 + 50)
    assert new.state is State.DEFERRED
    assert new.next_attempt_at == T0 + 50
    assert (new.version, new.updated_at) == (7, T0 + 50)
    assert new.audit == (AuditEntry(T0 + 50, "ops@acme", "release", "failed", "deferred"),)
    assert isinstance(ledger.decide(new, sub(), T0 + 50, S), Proceed)


def test_second_release_is_refused() -> None:
    once = ledger.release(rec(State.FAILED, reply=FAILED_REPLY), "ops", T0 + 1)
    with pytest.raises(OperatorRefused, match="not failed"):
        ledger.release(once, "ops", T0 + 2)


@pytest.mark.parametrize("state", [s for s in State if s is not State.FAILED], ids=str)
def test_release_refused_unless_failed(state: State) -> None:
    with pytest.raises(OperatorRefused):
        ledger.release(rec(state), "ops", T0)


# --- serialisation -----------------------------------------------------------------------------
FULL = Record(
    zone="acme",
    key=KEY,
    state=State.IN_FLIGHT,
    fingerprint=FP,
    created_at=T0,
    updated_at=T0 + 1.5,
    version=9,
    sg_id="A3",
    owner="i-1",
    lease_until=T0 + 31.5,
    phase=Phase.DATA_SENT,
    next_attempt_at=T0 + 60,
    reply=Reply(451, "4.3.0", "later"),
    upstream_id="Q7",
    message_id="<m@app>",
    valid_until=T0 + 600,
    attempts=(
        attempt("A1"),
        attempt(
            "A2",
            outcome="delivered",
            code=250,
            enhanced="2.0.0",
            upstream_id="Q7",
            message_id="<m@app>",
            rejected=(("bob@example.org", Reply(550, "5.1.1", "no such user")),),
        ),
        attempt("A3", provider=None, code=None, enhanced="", outcome="unavailable"),
    ),
    audit=(AuditEntry(T0, "ops", "release", "failed", "deferred", "cause fixed"),),
)


@pytest.mark.parametrize(
    "record",
    [
        pytest.param(FULL, id="every-field"),
        pytest.param(rec(State.DELIVERED), id="minimal"),
        pytest.param(rec(State.UNKNOWN, phase=None, reply=None), id="no-phase-no-reply"),
    ],
)
def test_record_round_trips_through_json(record: Record) -> None:
    d = record.to_dict()
    assert Record.from_dict(d) == record
    assert Record.from_dict(json.loads(json.dumps(d))) == record


def test_to_dict_uses_plain_values() -> None:
    d = FULL.to_dict()
    assert d["state"] == "in_flight" and d["phase"] == "data_sent"
    assert d["reply"] == {"code": 451, "enhanced": "4.3.0", "text": "later"}
    assert d["attempts"][1]["rejected"] == [
        ["bob@example.org", {"code": 550, "enhanced": "5.1.1", "text": "no such user"}]
    ]
    assert d["audit"][0]["note"] == "cause fixed"


def test_release_of_a_dropped_held_event_waits_for_its_lost_owner() -> None:
    # `queue drop` turns an unknown record failed; release must not bypass the wait that
    # resolve --as retry keeps (the owner may still get its 250).
    s = ledger.LedgerSettings(send_timeout=150.0)
    dead = rec(State.IN_FLIGHT, lease_until=T0 + 30, phase=Phase.DATA_SENT, owner="i-1", lane="bulk")
    verdict = ledger.on_claim(dead, "A3", "i-2", T0 + 31, s)
    assert isinstance(verdict, ledger.Finish) and verdict.record is not None
    assert verdict.record.state is State.UNKNOWN and verdict.record.lost_owner == "i-1"
    dropped = ledger.drop(verdict.record, "cli:alice", T0 + 40)
    with pytest.raises(ledger.RetryTooEarly):
        ledger.release(dropped, "cli:alice", T0 + 41)
    forced = ledger.release(dropped, "cli:alice", T0 + 41, force=True)
    assert forced.state is State.DEFERRED and "forced" in forced.audit[-1].note
    assert ledger.release(dropped, "cli:alice", T0 + 182).state is State.DEFERRED


def test_a_lost_owner_reporting_back_is_no_longer_sending() -> None:
    s = ledger.LedgerSettings(send_timeout=150.0)
    dead = rec(State.IN_FLIGHT, lease_until=T0 + 30, phase=Phase.DATA_SENT, owner="i-1")
    verdict = ledger.decide(dead, sub(), T0 + 31, s)
    assert isinstance(verdict, ledger.Transition)
    # A reply to the dot is an answer: the event is known again (here: refused).
    late = Outcome(Kind.FAILED, "primary", Reply(554, "5.7.1", "refused"), data_sent=True)
    told = ledger.settle(verdict.record, "A1", "i-1", late, T0 + 35, s)
    assert told.state is State.FAILED and told.lost_until is None
    # A refusal at MAIL: nothing was sent, retryable as any deferral.
    early = Outcome(Kind.DEFERRED, "primary", Reply(451, "4.3.0", "later"), data_sent=False)
    back = ledger.settle(verdict.record, "A1", "i-1", early, T0 + 35, s)
    assert back.state is State.DEFERRED and back.next_attempt_at == T0 + 35 + s.min_retry_interval
    # Its reply lost too: still unknown, and now nothing stops resolve --as retry.
    lost = Outcome(Kind.UNKNOWN, "primary", detail="timeout after DATA", data_sent=True)
    still = ledger.settle(verdict.record, "A1", "i-1", lost, T0 + 35, s)
    assert still.state is State.UNKNOWN and still.lost_until is None
    assert ledger.resolve(still, "retry", "cli:alice", T0 + 36).state is State.DEFERRED
    # Another instance's late report changes nothing.
    other = ledger.settle(verdict.record, "A1", "i-9", early, T0 + 35, s)
    assert other.state is State.UNKNOWN


def test_a_derived_keys_new_event_keeps_a_bounded_history() -> None:
    many = tuple(attempt(f"A{i}", outcome="delivered", code=250, at=T0 + i) for i in range(50))
    old = rec(State.DELIVERED, key="auto:" + FP, valid_until=T0 + 600, attempts=many)
    verdict = ledger.decide(old, sub(key="auto:" + FP, derived=True), T0 + 3600, S)
    assert isinstance(verdict, Proceed)
    assert verdict.record.attempts == many[-ledger.KEPT_HISTORY :]
    # Backoff and hold count this event's attempts only.
    assert ledger.attempts_of_this_event(verdict.record) == 0


def test_an_entry_expiring_under_a_dead_worker_gives_its_unit_back() -> None:
    dead = rec(
        State.IN_FLIGHT,
        lease_until=T0 + 30,
        phase=Phase.BEFORE_DATA,
        sg_id="X1",
        lane="otp",
        expires_at=T0 + 20,
    )
    verdict = ledger.on_claim(dead, "X2", "w2", T0 + 31, S)
    assert isinstance(verdict, ledger.Finish) and verdict.decision == "expired"
    assert verdict.refund == ("X1",) and verdict.record is not None and verdict.record.unrefunded == ()


def test_evolve_is_dataclasses_replace_for_every_field() -> None:
    """ledger.evolve copies a Record field by field for speed: every field — including one
    another branch adds later — must come through, and a misspelt change must raise as
    dataclasses.replace does, not vanish (a lost state change)."""
    from dataclasses import fields

    names = [f.name for f in fields(Record)]
    full = Record(**{n: ("old", n) for n in names})
    assert ledger.evolve(full) == full
    for n in names:
        got = ledger.evolve(full, **{n: ("new", n)})
        assert got == replace(full, **{n: ("new", n)})
        assert [getattr(got, m) for m in names] == [("new", n) if m == n else ("old", m) for m in names]
    with pytest.raises(TypeError, match="stat"):
        ledger.evolve(full, stat=State.DELIVERED)
    with pytest.raises(TypeError):
        replace(full, stat=State.DELIVERED)
