"""policy/outbox.py: a submission's answer → the row's receipt, as tables (DESIGN.md §20)."""

from __future__ import annotations

import pytest

from smtpguard import replies
from smtpguard.policy.decisions import Decision
from smtpguard.policy.message import HeaderLimits
from smtpguard.policy.outbox import (
    Retry,
    RowState,
    became_due,
    receipt,
    settled,
    size_refusal,
    wire_form,
    with_key,
)
from smtpguard.replies import Reply

RETRY = Retry(base=60.0, ceiling=3600.0, min_interval=60.0, follow_every=30.0)
NOW = 1_000_000.0
DAY = 86400.0
LIMITS = HeaderLimits()

CASES = [
    # decision, reply, expected state, done, follow
    (Decision.RELAYED, Reply(250, "2.0.0", "[sg:x] queued as Q1"), RowState.SENT, True, False),
    (Decision.DUPLICATE, replies.duplicate("k", "x", "Q1"), RowState.DUPLICATE, True, False),
    (Decision.FAILED, Reply(550, "5.1.1", "[sg:x] no such user"), RowState.FAILED, True, False),
    (Decision.FAILED_HELD, Reply(550, "5.1.1", "[sg:x] no such user"), RowState.FAILED, True, False),
    (Decision.ENVELOPE, replies.sender_not_allowed("a@b.example", "acme"), RowState.FAILED, True, False),
    (Decision.REUSED, replies.key_reused("k"), RowState.FAILED, True, False),
    (Decision.UNKNOWN, replies.outcome_unknown("k"), RowState.HELD, False, True),
    (Decision.UNKNOWN_HELD, replies.outcome_unknown("k"), RowState.HELD, False, True),
    (Decision.QUEUED, replies.queued("x"), RowState.PENDING, False, True),
    (Decision.PAUSED, replies.paused("acme"), RowState.PENDING, False, False),
    (Decision.CAP_HOUR, replies.hourly_cap("acme", 20, NOW + 600), RowState.PENDING, False, False),
    (Decision.DEFERRED, Reply(451, "4.3.0", "[sg:x] later"), RowState.PENDING, False, False),
    (Decision.UNAVAILABLE, replies.no_provider(), RowState.PENDING, False, False),
    (Decision.STORE_UNAVAILABLE, replies.STORE_UNAVAILABLE, RowState.PENDING, False, False),
    (Decision.IN_FLIGHT, replies.in_flight("k"), RowState.PENDING, False, False),
]


@pytest.mark.parametrize(("decision", "reply", "state", "done", "follow"), CASES)
def test_a_reply_makes_the_row_state(
    decision: str, reply: Reply, state: RowState, done: bool, follow: bool
) -> None:
    r = receipt(decision, reply, NOW, NOW - 10, 3 * DAY, 1, RETRY, 0.5)
    assert (r.state, r.done, r.follow) == (state, done, follow)
    assert (r.next_attempt_at is None) == done


@pytest.mark.parametrize(
    ("attempts", "jitter", "lowest", "highest"),
    [
        (1, 0.0, 60.0, 60.0),  # backoff base/2 = 30 s, but never under min_retry_interval
        (1, 0.999, 60.0, 60.0),
        (3, 0.0, 120.0, 120.0),  # 240 s: half fixed, half jittered
        (3, 0.999, 239.0, 240.0),
        (20, 0.5, 2700.0, 2700.0),  # the ceiling: 1800 + 900
    ],
)
def test_a_4xx_backs_off_with_jitter_never_under_min_retry_interval(
    attempts: int, jitter: float, lowest: float, highest: float
) -> None:
    r = receipt(Decision.DEFERRED, Reply(451, "4.3.0", "later"), NOW, NOW, 3 * DAY, attempts, RETRY, jitter)
    assert r.next_attempt_at is not None
    assert lowest <= r.next_attempt_at - NOW <= highest


def test_a_4xx_past_the_class_max_age_expires_and_a_retry_never_lands_past_it() -> None:
    temp = Reply(451, "4.7.0", "paused")
    assert receipt(Decision.PAUSED, temp, NOW, NOW - 601, 600, 3, RETRY, 0.5).state is RowState.EXPIRED
    late = receipt(Decision.PAUSED, temp, NOW, NOW - 590, 600, 3, RETRY, 0.5)
    assert late.state is RowState.PENDING and late.next_attempt_at == NOW + 10
    # Scheduled: the age counts from its not_before, not from when it was written.
    due = became_due(NOW - 4 * DAY, NOW - 60)
    assert due == NOW - 60 and became_due(NOW - 60, None) == became_due(NOW - 60, NOW - DAY) == NOW - 60
    scheduled = receipt(Decision.PAUSED, temp, NOW, due, 600, 20, RETRY, 0.5)
    assert scheduled.state is RowState.PENDING and scheduled.next_attempt_at == NOW + 540
    # A 5xx or a 250 is answered whatever the age.
    assert (
        receipt(Decision.RELAYED, Reply(250, "2.0.0", "ok"), NOW, 0, 600, 1, RETRY, 0).state is RowState.SENT
    )


@pytest.mark.parametrize(
    ("record", "row"),
    [
        ("delivered", RowState.SENT),
        ("failed", RowState.FAILED),
        ("expired", RowState.EXPIRED),
        ("deferred", RowState.PENDING),
        (None, RowState.PENDING),
        ("unknown", None),
        ("queued", None),
        ("in_flight", None),
    ],
)
def test_a_followed_row_takes_its_records_settled_state(record: str | None, row: RowState | None) -> None:
    assert settled(record) is row


def test_wire_form_ends_every_line_with_crlf_and_keeps_a_nul() -> None:
    assert wire_form(b"A: 1\nB: 2\r\n\r\nx\ry\n") == b"A: 1\r\nB: 2\r\n\r\nx\r\ny\r\n"
    assert b"\x00" in wire_form(b"A: 1\n\nx\x00\n")


def test_the_rows_key_goes_into_the_key_header_and_a_different_one_is_refused() -> None:
    keyed = with_key(b"Subject: s\r\n\r\nb", "X-Event-Key", "k:1", LIMITS)
    assert keyed == b"X-Event-Key: k:1\r\nSubject: s\r\n\r\nb"
    same = b"x-event-key: k:1\r\n\r\nb"
    assert with_key(same, "X-Event-Key", "k:1", LIMITS) == same
    other = with_key(b"X-Event-Key: k:2\r\n\r\nb", "X-Event-Key", "k:1", LIMITS)
    assert isinstance(other, Reply) and other.code == 550 and other.enhanced == "5.6.0"


def test_a_key_header_folded_as_encoded_words_is_compared_as_the_key_it_decodes_to() -> None:
    # The listener reads a folded X-Event-Key as the key its encoded-words decode to
    # (policy/eventkey.py written_key). Compared by its first line alone, a message whose
    # header decodes to another row's key ("order:2") passed under the row key "=?utf-8?q?order?="
    # and was sent, and recorded, as order:2: that row's own event was then a duplicate.
    folded = b"X-Event-Key: =?utf-8?q?order?=\r\n =?utf-8?q?=3A2?=\r\nSubject: s\r\n\r\nb"
    other = with_key(folded, "X-Event-Key", "=?utf-8?q?order?=", LIMITS)
    assert isinstance(other, Reply) and other.code == 550 and other.enhanced == "5.6.0"
    # The same header names the row whose key it decodes to: that row's message, as written.
    assert with_key(folded, "X-Event-Key", "order:2", LIMITS) == folded
    undecodable = b"X-Event-Key: =?x-unknown?q?a?=\r\n =?x-unknown?q?b?=\r\n\r\nb"
    assert isinstance(with_key(undecodable, "X-Event-Key", "=?x-unknown?q?a?=", LIMITS), Reply)


@pytest.mark.parametrize("key", ["", "a b", "a\r\nBcc: x@evil.example", "tab\there", "del\x7f"])
def test_a_key_that_would_inject_or_is_malformed_is_refused_before_any_header_is_written(key: str) -> None:
    refused = with_key(b"Subject: s\r\n\r\nb", "X-Event-Key", key, LIMITS)
    assert isinstance(refused, Reply) and refused.code == 550


def test_the_size_limit_is_the_listeners() -> None:
    assert size_refusal(10, 10) is None
    assert size_refusal(11, 10) == replies.SIZE_EXCEEDED
