"""Store-and-forward policy: backoff, lanes, and the worker's ledger transitions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, Phase, State, Submission
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.policy.queue import HELD, backoff_delay, lane_quotas, queue_due
from smtpguard.replies import Reply

NOW = 1_800_000_000.0
S = LedgerSettings(min_retry_interval=60, lease=30, derive_window=600)
LANES = [("bulk", 2), ("otp", 0), ("transactional", 1)]


def queued(max_age: float = 600.0) -> ledger.Record:
    sub = Submission("acme", "k", "fp", "id0", "inst", "<m@x>", lane="transactional", max_age=max_age)
    verdict = ledger.decide(None, sub, NOW, S)
    assert isinstance(verdict, ledger.Proceed)
    return verdict.record


@pytest.mark.parametrize(
    ("attempt", "jitter", "expected"),
    [
        (1, 0.0, 30.0),
        (1, 0.999999, 60.0),
        (2, 0.0, 60.0),
        (3, 0.5, 180.0),
        (10, 0.0, 1800.0),
        (30, 1.0, 3600.0),
    ],
)
def test_backoff_doubles_with_equal_jitter_and_caps(attempt: int, jitter: float, expected: float) -> None:
    assert backoff_delay(attempt, 60.0, 3600.0, jitter) == pytest.approx(expected, rel=1e-5)


def test_lane_quotas_order_and_totals() -> None:
    quotas = lane_quotas(8, LANES, [0.0] * 8)
    assert [name for name, _ in quotas] == ["otp", "transactional", "bulk"]
    assert quotas == [("otp", 8), ("transactional", 0), ("bulk", 0)]
    assert lane_quotas(0, LANES, []) == []
    assert sum(n for _, n in lane_quotas(5, LANES, [0.1, 0.8, 0.97, 0.99, 0.5])) == 5


def test_lane_quotas_never_starve_bulk() -> None:
    rng = random.Random(7)
    got: Counter[str] = Counter()
    for _ in range(2000):
        for name, n in lane_quotas(1, LANES, [rng.random()]):
            got[name] += n
    # weights 16:4:1 → bulk ≈ 4.8%, transactional ≈ 19%, otp ≈ 76%
    assert 60 <= got["bulk"] <= 150
    assert 300 <= got["transactional"] <= 480
    assert got["otp"] > 1400


def test_fresh_queued_record_and_duplicates() -> None:
    rec = queued()
    assert rec.state is State.QUEUED and rec.lane == "transactional" and rec.queue_id == "id0"
    assert rec.expires_at == NOW + 600 and rec.next_attempt_at == NOW and rec.owner is None
    sub = Submission("acme", "k", "fp", "id1", "inst", None, lane="transactional", max_age=600)
    for state in (State.QUEUED, State.DEFERRED, State.IN_FLIGHT):
        from dataclasses import replace

        verdict = ledger.decide(replace(rec, state=state), sub, NOW + 1, S)
        assert isinstance(verdict, ledger.Answer)
        assert verdict.reply.code == 250 and "queued" in verdict.reply.text and "id0" in verdict.reply.text


def test_on_claim_delivers_expires_and_recovers() -> None:
    rec = queued()
    verdict = ledger.on_claim(rec, "a1", "w", NOW + 1, S)
    assert isinstance(verdict, ledger.Deliver)
    taken = verdict.record
    assert taken.state is State.IN_FLIGHT and taken.owner == "w" and taken.phase is Phase.BEFORE_DATA
    assert taken.sg_id == "a1" and taken.queue_id == "id0"
    # expired by max_age: never sent
    gone = ledger.on_claim(rec, "a2", "w", NOW + 601, S)
    assert isinstance(gone, ledger.Finish) and gone.record is not None
    assert gone.record.state is State.EXPIRED and queue_due(gone.record) is None
    # a live lease elsewhere: leave it
    assert ledger.on_claim(taken, "a3", "w2", NOW + 2, S) == ledger.Finish(None, "busy")
    # owner died before DATA: retried; after DATA: unknown, held
    again = ledger.on_claim(taken, "a4", "w2", NOW + 40, S)
    assert isinstance(again, ledger.Deliver) and again.record.owner == "w2"
    sent = ledger.mark_data_sent(taken, "a1", NOW + 2, S)
    assert sent is not None
    lost = ledger.on_claim(sent, "a5", "w2", NOW + 40, S)
    assert isinstance(lost, ledger.Finish) and lost.record is not None
    assert lost.record.state is State.UNKNOWN and queue_due(lost.record) == HELD


def test_settle_with_retry_delay_and_hold() -> None:
    verdict = ledger.on_claim(queued(), "a1", "w", NOW, S)
    assert isinstance(verdict, ledger.Deliver)
    taken = verdict.record
    deferred = ledger.settle(
        taken,
        "a1",
        "w",
        Outcome(Kind.DEFERRED, "p", Reply(451, "4.3.0", "later")),
        NOW + 1,
        S,
        retry_delay=42.0,
    )
    assert deferred.state is State.DEFERRED and deferred.next_attempt_at == NOW + 43
    assert queue_due(deferred) == NOW + 43
    unavailable = ledger.settle(
        taken, "a1", "w", Outcome(Kind.UNAVAILABLE, None), NOW + 1, S, retry_delay=5.0
    )
    assert unavailable.next_attempt_at == NOW + 6
    held = ledger.hold(taken, "a1", NOW + 1, NOW + 300)
    assert held is not None and held.state is State.QUEUED and held.next_attempt_at == NOW + 300
    # A hold past the entry's max_age ends at it, so the entry is expired then, not later.
    assert taken.expires_at is not None and taken.expires_at < NOW + 3600
    held_long = ledger.hold(taken, "a1", NOW + 1, NOW + 3600)
    assert held_long is not None and held_long.next_attempt_at == taken.expires_at
    assert ledger.hold(taken, "other", NOW, NOW) is None


def test_operator_drop_and_retry_now() -> None:
    rec = queued()
    dropped = ledger.drop(rec, "op", NOW)
    assert dropped.state is State.FAILED and dropped.reply is not None
    assert queue_due(dropped) == HELD  # the message stays, so `release` can still send it
    assert dropped.reply.text == "dropped by operator" and dropped.audit[-1].action == "drop"
    with pytest.raises(ledger.OperatorRefused):
        ledger.drop(dropped, "op", NOW)
    later = ledger.retry_now(rec, "op", NOW + 5)
    assert later.next_attempt_at == NOW + 5 and later.audit[-1].action == "queue_retry"
    with pytest.raises(ledger.OperatorRefused):
        ledger.retry_now(dropped, "op", NOW)


def test_wake_brings_a_held_entry_back_now_and_nothing_else() -> None:
    """`resume --class`: an entry held while its class was paused is due at once; a record
    that is not a held queue entry, or one due later than any pause holds it, is left."""
    verdict = ledger.on_claim(queued(), "a1", "w", NOW, S)
    assert isinstance(verdict, ledger.Deliver)
    held = ledger.hold(verdict.record, "a1", NOW, NOW + 30)
    assert held is not None
    woken = ledger.wake(held, NOW + 1, within=30)
    assert woken is not None
    assert woken.next_attempt_at == NOW + 1 and woken.version == held.version + 1
    assert woken.attempts == held.attempts and woken.audit == held.audit and woken.state is State.QUEUED
    assert ledger.wake(woken, NOW + 1, within=30) is None  # due already
    assert ledger.wake(held, NOW + 1, within=10) is None  # held longer than a pause holds
    assert ledger.wake(verdict.record, NOW + 1, within=30) is None  # in flight: its worker's
