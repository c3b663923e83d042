"""The relay's failover table (DESIGN.md §6, §11.6, §16): what each provider answer means for
the event, and whether the route may try the next provider, without sockets or clocks.

Failover only while nothing can have been accepted: never after the final dot. One case per
row: every outcome class, before or after DATA, by what the rest of the route holds (nothing,
a usable provider, one whose circuit is open, one that answers with a rate limit).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from smtpguard.policy.breaker import Breaker, Circuit
from smtpguard.policy.failover import (
    Attempted,
    Walk,
    after_retry,
    before_dot_reply,
    connections_busy,
    data_reply,
    eightbitmime_missing,
    health_after,
    rate_limited,
    refused_all,
    reply_class,
    retries_same,
    unavailable,
    unknown,
)
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.policy.throttle import CONNECTION_WAIT
from smtpguard.replies import Reply

NOW = 1000.0


# --- part A: each answer, at its stage, as an Attempted -----------------------------------------
def test_unavailable_before_data_may_fail_over_and_counts_against_the_circuit() -> None:
    a = unavailable("a", "connect: OSError: refused")
    assert a == Attempted(
        Outcome(Kind.UNAVAILABLE, "a", detail="connect: OSError: refused", data_sent=False),
        failover=True,
        health="fail",
    )


def test_unavailable_for_the_messages_fault_leaves_the_circuit_alone() -> None:
    a = unavailable("a", "before DATA: ValueError: x", health="ok")
    assert a.failover and a.health == "ok" and a.outcome.kind is Kind.UNAVAILABLE


@pytest.mark.parametrize(
    ("code", "text", "kind", "failover", "health", "limited"),
    [
        (450, "4.2.0 mailbox busy", Kind.DEFERRED, True, "ok", False),
        (452, "4.5.3 too many recipients", Kind.DEFERRED, True, "ok", False),
        (451, "4.7.1 greylisted", Kind.DEFERRED, True, "ok", False),
        (451, "4.7.0 rate limit exceeded", Kind.UNAVAILABLE, True, "ok", True),
        (421, "4.7.0 too many connections", Kind.UNAVAILABLE, True, "ok", True),
        (550, "5.1.1 no such user", Kind.FAILED, False, "ok", False),
        (554, "5.7.1 relay denied", Kind.FAILED, False, "ok", False),
    ],
)
def test_a_reply_before_the_dot(
    code: int, text: str, kind: Kind, failover: bool, health: str, limited: bool
) -> None:
    a = before_dot_reply("a", code, text)
    assert (a.outcome.kind, a.failover, a.health, a.rate_limited) == (kind, failover, health, limited)
    assert a.outcome.data_sent is False and a.outcome.provider == "a"
    assert a.outcome.reply is not None and a.outcome.reply.code == code


def test_a_rate_limit_is_unavailable_with_the_providers_reply() -> None:
    reply = Reply(421, "4.7.0", "slow down")
    a = rate_limited("a", reply)
    assert a == Attempted(
        Outcome(Kind.UNAVAILABLE, "a", reply, detail=f"rate limited: {reply}", data_sent=False),
        failover=True,
        health="ok",
        rate_limited=True,
    )


def test_no_connection_slot_tried_nothing() -> None:
    a = connections_busy("a")
    assert a.busy and a.failover and a.health == "ok" and not a.rate_limited
    assert a.outcome == Outcome(
        Kind.UNAVAILABLE, "a", detail="max_connections in use on every instance", data_sent=False
    )


def test_unknown_after_data_is_never_failed_over() -> None:
    rejected = [("x@example.org", Reply(550, "5.1.1", "no"))]
    a = unknown("a", "TimeoutError: read", rejected)
    assert a == Attempted(
        Outcome(
            Kind.UNKNOWN,
            "a",
            detail="after DATA: TimeoutError: read",
            rejected=tuple(rejected),
            data_sent=True,
        ),
        failover=False,
        health="fail",
    )


def test_every_recipient_refused_for_good_fails_with_the_first_reply() -> None:
    first, second = Reply(550, "5.1.1", "no such user"), Reply(553, "5.1.3", "bad address")
    a = refused_all("a", [("x@example.org", first), ("y@example.org", second)])
    assert (a.outcome.kind, a.outcome.reply, a.failover, a.health) == (Kind.FAILED, first, False, "ok")
    assert a.outcome.data_sent is False and len(a.outcome.rejected) == 2


def test_one_recipient_refused_for_now_defers_the_whole_event_and_may_fail_over() -> None:
    temp = Reply(450, "4.2.0", "mailbox busy")
    a = refused_all("a", [("x@example.org", Reply(550, "5.1.1", "no")), ("y@example.org", temp)])
    assert (a.outcome.kind, a.outcome.reply, a.failover, a.health) == (Kind.DEFERRED, temp, True, "ok")


def test_a_recipient_refused_with_a_rate_limit_throttles() -> None:
    temp = Reply(451, "4.7.0", "too many messages")
    a = refused_all("a", [("y@example.org", temp)])
    assert a.rate_limited and a.failover and a.outcome.kind is Kind.UNAVAILABLE


# --- part B: the route's choice ------------------------------------------------------------------
REFUSED = Reply(550, "5.1.1", "no such user")
UTF8 = Reply(553, "5.6.7", "a does not offer SMTPUTF8")
GONE = unavailable("a", "connect: OSError: refused")
DEFER_BEFORE = before_dot_reply("a", 450, "4.2.0 mailbox busy")
LIMITED = rate_limited("a", Reply(421, "4.7.0", "slow down"))
BUSY = connections_busy("a")
AUTH = Attempted(
    Outcome(
        Kind.UNAVAILABLE, "a", Reply(535, "5.7.8", "bad"), detail="upstream AUTH refused", data_sent=False
    ),
    failover=True,
    health="trip",
)
NO_UTF8 = Attempted(Outcome(Kind.FAILED, "a", UTF8, data_sent=False), failover=True, health="ok")
FAIL_BEFORE = before_dot_reply("a", 550, "5.1.1 no such user")
DELIVERED = Attempted(
    Outcome(Kind.DELIVERED, "a", Reply(250, "2.0.0", "ok"), data_sent=True), failover=False, health="ok"
)
DEFER_AFTER = Attempted(
    Outcome(Kind.DEFERRED, "a", Reply(451, "4.3.0", "try later"), data_sent=True), failover=False, health="ok"
)
FAIL_AFTER = Attempted(
    Outcome(Kind.FAILED, "a", Reply(554, "5.6.0", "bad message"), data_sent=True), failover=False, health="ok"
)
UNKNOWN = unknown("a", "TimeoutError: read", [])

B_DELIVERS = Attempted(
    Outcome(Kind.DELIVERED, "b", Reply(250, "2.0.0", "ok"), data_sent=True), failover=False, health="ok"
)
B_LIMITED = rate_limited("b", Reply(421, "4.7.0", "slow down"))


@dataclass(frozen=True)
class Row:
    first: Attempted
    rest: str
    """What follows provider a on the route: none, usable, open (circuit), limited (rate limit)."""
    kind: Kind
    provider: str | None
    b_tried: bool
    wait_until: float | None
    a_circuit: Circuit
    idempotent: bool = False
    retry: Attempted | None = None


OPEN, C = Circuit.OPEN, Circuit.CLOSED
ROWS = {
    # before DATA, nothing accepted: the next usable provider is tried
    "unavailable-alone": Row(GONE, "none", Kind.UNAVAILABLE, "a", False, None, OPEN),
    "unavailable-usable": Row(GONE, "usable", Kind.DELIVERED, "b", True, None, OPEN),
    "unavailable-open": Row(GONE, "open", Kind.UNAVAILABLE, "a", False, None, OPEN),
    "unavailable-limited": Row(GONE, "limited", Kind.UNAVAILABLE, "b", True, NOW, OPEN),
    "deferred-before-alone": Row(DEFER_BEFORE, "none", Kind.DEFERRED, "a", False, None, C),
    "deferred-before-usable": Row(DEFER_BEFORE, "usable", Kind.DELIVERED, "b", True, None, C),
    "deferred-before-open": Row(DEFER_BEFORE, "open", Kind.DEFERRED, "a", False, None, C),
    "deferred-before-limited": Row(DEFER_BEFORE, "limited", Kind.DEFERRED, "a", True, None, C),
    "rate-limited-alone": Row(LIMITED, "none", Kind.UNAVAILABLE, "a", False, NOW, C),
    "rate-limited-usable": Row(LIMITED, "usable", Kind.DELIVERED, "b", True, None, C),
    "rate-limited-open": Row(LIMITED, "open", Kind.UNAVAILABLE, "a", False, NOW, C),
    "rate-limited-limited": Row(LIMITED, "limited", Kind.UNAVAILABLE, "b", True, NOW, C),
    "busy-alone": Row(BUSY, "none", Kind.UNAVAILABLE, "a", False, NOW + 1.0, C),
    "busy-usable": Row(BUSY, "usable", Kind.DELIVERED, "b", True, None, C),
    "busy-open": Row(BUSY, "open", Kind.UNAVAILABLE, "a", False, NOW + 1.0, C),
    "busy-limited": Row(BUSY, "limited", Kind.UNAVAILABLE, "b", True, NOW, C),
    "auth-refused-alone": Row(AUTH, "none", Kind.UNAVAILABLE, "a", False, None, OPEN),
    "auth-refused-usable": Row(AUTH, "usable", Kind.DELIVERED, "b", True, None, OPEN),
    "auth-refused-open": Row(AUTH, "open", Kind.UNAVAILABLE, "a", False, None, OPEN),
    "auth-refused-limited": Row(AUTH, "limited", Kind.UNAVAILABLE, "b", True, NOW, OPEN),
    # refused only for what a lacks: a 553 only when no other provider could have been asked
    "no-smtputf8-alone": Row(NO_UTF8, "none", Kind.FAILED, "a", False, None, C),
    "no-smtputf8-usable": Row(NO_UTF8, "usable", Kind.DELIVERED, "b", True, None, C),
    "no-smtputf8-open": Row(NO_UTF8, "open", Kind.UNAVAILABLE, "a", False, None, C),
    "no-smtputf8-limited": Row(NO_UTF8, "limited", Kind.UNAVAILABLE, "a", True, NOW, C),
    # a permanent refusal before DATA is the event's answer: no failover
    "failed-before-alone": Row(FAIL_BEFORE, "none", Kind.FAILED, "a", False, None, C),
    "failed-before-usable": Row(FAIL_BEFORE, "usable", Kind.FAILED, "a", False, None, C),
    "failed-before-open": Row(FAIL_BEFORE, "open", Kind.FAILED, "a", False, None, C),
    "failed-before-limited": Row(FAIL_BEFORE, "limited", Kind.FAILED, "a", False, None, C),
    # after the final dot the outcome is a's, whatever follows
    "delivered-alone": Row(DELIVERED, "none", Kind.DELIVERED, "a", False, None, C),
    "delivered-usable": Row(DELIVERED, "usable", Kind.DELIVERED, "a", False, None, C),
    "delivered-open": Row(DELIVERED, "open", Kind.DELIVERED, "a", False, None, C),
    "delivered-limited": Row(DELIVERED, "limited", Kind.DELIVERED, "a", False, None, C),
    "deferred-after-alone": Row(DEFER_AFTER, "none", Kind.DEFERRED, "a", False, None, C),
    "deferred-after-usable": Row(DEFER_AFTER, "usable", Kind.DEFERRED, "a", False, None, C),
    "deferred-after-open": Row(DEFER_AFTER, "open", Kind.DEFERRED, "a", False, None, C),
    "deferred-after-limited": Row(DEFER_AFTER, "limited", Kind.DEFERRED, "a", False, None, C),
    "failed-after-alone": Row(FAIL_AFTER, "none", Kind.FAILED, "a", False, None, C),
    "failed-after-usable": Row(FAIL_AFTER, "usable", Kind.FAILED, "a", False, None, C),
    "failed-after-open": Row(FAIL_AFTER, "open", Kind.FAILED, "a", False, None, C),
    "failed-after-limited": Row(FAIL_AFTER, "limited", Kind.FAILED, "a", False, None, C),
    "unknown-alone": Row(UNKNOWN, "none", Kind.UNKNOWN, "a", False, None, OPEN),
    "unknown-usable": Row(UNKNOWN, "usable", Kind.UNKNOWN, "a", False, None, OPEN),
    "unknown-open": Row(UNKNOWN, "open", Kind.UNKNOWN, "a", False, None, OPEN),
    "unknown-limited": Row(UNKNOWN, "limited", Kind.UNKNOWN, "a", False, None, OPEN),
    # an idempotent provider gets one more try; only its 250 settles the event
    "unknown-idempotent-delivered": Row(
        UNKNOWN, "usable", Kind.DELIVERED, "a", False, None, C, idempotent=True, retry=DELIVERED
    ),
    "unknown-idempotent-unavailable": Row(
        UNKNOWN, "usable", Kind.UNKNOWN, "a", False, None, OPEN, idempotent=True, retry=GONE
    ),
    "unknown-idempotent-deferred": Row(
        UNKNOWN, "usable", Kind.UNKNOWN, "a", False, None, C, idempotent=True, retry=DEFER_BEFORE
    ),
}


def walk(row: Row) -> tuple[Outcome, bool, Circuit]:
    """The route's walk over a then b, as the policy decides it. A rate limit is noted as the
    gate would answer it without a store (usable again now); a busy pool as CONNECTION_WAIT."""
    w = Walk()
    circuit_a = Breaker(1, 60)

    def note(result: Attempted) -> None:
        if result.rate_limited:
            w.throttled(NOW)
        elif result.busy:
            w.throttled(NOW + CONNECTION_WAIT)

    result = row.first
    note(result)
    circuit_a = health_after(circuit_a, result.health, NOW)
    assert retries_same(result, row.idempotent) is (row.retry is not None)
    if row.retry is not None:
        circuit_a = health_after(circuit_a, row.retry.health, NOW)
        result = after_retry(result, row.retry)
    ended = w.tried(result)
    b_tried = False
    if ended is None and row.rest == "open":
        w.circuit_open()
    elif ended is None and row.rest != "none":
        b_tried = True
        second = B_LIMITED if row.rest == "limited" else B_DELIVERS
        note(second)
        ended = w.tried(second)
    return w.end(ended if ended is not None else w.exhausted()), b_tried, circuit_a.circuit


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_the_route_table(row: Row) -> None:
    outcome, b_tried, a_circuit = walk(row)
    assert (outcome.kind, outcome.provider, b_tried, outcome.wait_until, a_circuit) == (
        row.kind,
        row.provider,
        row.b_tried,
        row.wait_until,
        row.a_circuit,
    )


def test_every_circuit_open_tries_nothing_and_says_so() -> None:
    w = Walk()
    w.circuit_open()
    assert w.end(w.exhausted()) == Outcome(
        Kind.UNAVAILABLE, None, detail="every provider circuit is open", data_sent=False
    )


def test_every_provider_throttled_says_when_to_come_back() -> None:
    w = Walk()
    w.throttled(NOW + 5)
    w.throttled(NOW + 2)
    assert w.end(w.exhausted()) == Outcome(
        Kind.UNAVAILABLE, None, detail="every provider is throttled", data_sent=False, wait_until=NOW + 2
    )


def test_throttled_and_open_circuits_name_the_circuits() -> None:
    w = Walk()
    w.throttled(NOW + 5)
    w.circuit_open()
    outcome = w.end(w.exhausted())
    assert (outcome.detail, outcome.wait_until) == ("every provider circuit is open", NOW + 5)


def test_a_refusal_for_what_one_provider_lacks_is_retryable_while_another_is_out() -> None:
    outcome, _, _ = walk(ROWS["no-smtputf8-open"])
    assert outcome == Outcome(
        Kind.UNAVAILABLE, "a", detail=f"{UTF8}; another provider unavailable", data_sent=False
    )


@pytest.mark.parametrize(
    ("outcome", "label"),
    [
        (Outcome(Kind.DELIVERED, "a", Reply(250, "2.0.0", "ok")), "2xx"),
        (Outcome(Kind.DEFERRED, "a", Reply(451, "4.3.0", "later")), "4xx"),
        (Outcome(Kind.FAILED, "a", Reply(554, "5.6.0", "no")), "5xx"),
        (Outcome(Kind.UNKNOWN, "a"), "unknown"),
        (Outcome(Kind.UNAVAILABLE, "a", Reply(421, "4.7.0", "slow")), "unavailable"),
        (Outcome(Kind.FAILED, "a"), "failed"),
    ],
)
def test_the_upstream_metric_label(outcome: Outcome, label: str) -> None:
    assert reply_class(outcome) == label


@pytest.mark.parametrize("first", [NO_UTF8, eightbitmime_missing("a")], ids=["no-smtputf8", "no-8bitmime"])
def test_a_refusal_for_what_one_provider_lacks_gives_way_to_anothers_try_later(first: Attempted) -> None:
    # a lacks what the message needs; b could take it and says "later": the event is
    # deferred with b's reply (its retry reaches b), never failed for good with a's 5xx.
    b_later = before_dot_reply("b", 451, "4.3.0 try later")
    w = Walk()
    assert w.tried(first) is None and w.tried(b_later) is None
    assert w.end(w.exhausted()) == b_later.outcome


def test_a_reply_to_the_data_command_itself_is_a_reply_before_the_message() -> None:
    # No byte of the message was written (it goes only after a 354): nothing accepted.
    later = data_reply("a", 451, "4.3.0 queue file write error", [], body_written=False)
    assert later.outcome.kind is Kind.DEFERRED and later.failover and not later.outcome.data_sent
    refused = data_reply("a", 554, "5.5.1 no valid recipients", [], body_written=False)
    assert refused.outcome.kind is Kind.FAILED and not refused.failover and not refused.outcome.data_sent
    limited = data_reply("a", 421, "4.7.0 slow down", [], body_written=False)
    assert limited.rate_limited and limited.failover and limited.outcome.kind is Kind.UNAVAILABLE
    # After the message, the same 451 is the message's outcome: never failed over.
    after = data_reply("a", 451, "4.3.0 try later", [], body_written=True)
    assert after.outcome.kind is Kind.DEFERRED and not after.failover and after.outcome.data_sent
