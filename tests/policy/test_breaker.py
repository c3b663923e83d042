"""The circuit breaker of DESIGN.md §6 as a transition table: closed ▸ open ▸ half_open ▸ closed."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from smtpguard.policy.breaker import Breaker, Circuit

T0 = 1_000.0
CLOSED = Breaker(threshold=3, cooldown=30.0)
OPEN = Breaker(threshold=3, cooldown=30.0, circuit=Circuit.OPEN, failures=3, opened_at=T0)
HALF = HALF_OPEN_PROBING = Breaker(
    threshold=3, cooldown=30.0, circuit=Circuit.HALF_OPEN, failures=3, opened_at=T0, probing=True
)
HALF_OPEN_IDLE = Breaker(
    threshold=3, cooldown=30.0, circuit=Circuit.HALF_OPEN, failures=3, opened_at=T0, probing=False
)


def fail(n: int, start: Breaker = CLOSED, at: float = T0) -> Breaker:
    b = start
    for i in range(n):
        b = b.failure(at + i)
    return b


# (name, start, event, circuit after, failures after, opened_at after, probing after)
Event = Callable[[Breaker], Breaker]
TRANSITIONS: list[tuple[str, Breaker, Event, Circuit, int, float, bool]] = [
    ("closed-first-failure", CLOSED, lambda b: b.failure(T0), Circuit.CLOSED, 1, 0.0, False),
    ("closed-below-threshold", fail(1), lambda b: b.failure(T0 + 1), Circuit.CLOSED, 2, 0.0, False),
    ("closed-at-threshold-opens", fail(2), lambda b: b.failure(T0 + 2), Circuit.OPEN, 3, T0 + 2, False),
    ("closed-success-resets-count", fail(2), lambda b: b.success(), Circuit.CLOSED, 0, 0.0, False),
    ("closed-trip-opens-at-once", CLOSED, lambda b: b.trip(T0 + 5), Circuit.OPEN, 3, T0 + 5, False),
    ("half-open-probe-success-closes", HALF, lambda b: b.success(), Circuit.CLOSED, 0, T0, False),
    (
        "half-open-probe-failure-reopens",
        HALF_OPEN_PROBING,
        lambda b: b.failure(T0 + 40),
        Circuit.OPEN,
        3,
        T0 + 40,
        False,
    ),
    ("half-open-trip", HALF_OPEN_PROBING, lambda b: b.trip(T0 + 41), Circuit.OPEN, 3, T0 + 41, False),
    ("half-open-release-probe", HALF, lambda b: b.release_probe(), Circuit.HALF_OPEN, 3, T0, False),
    ("closed-release-probe-no-op", fail(1), lambda b: b.release_probe(), Circuit.CLOSED, 1, 0.0, False),
    ("open-release-probe-no-op", OPEN, lambda b: b.release_probe(), Circuit.OPEN, 3, T0, False),
]


@pytest.mark.parametrize(
    ("start", "event", "circuit", "failures", "opened_at", "probing"),
    [pytest.param(*row[1:], id=row[0]) for row in TRANSITIONS],
)
def test_transition(
    start: Breaker, event: Event, circuit: Circuit, failures: int, opened_at: float, probing: bool
) -> None:
    after = event(start)
    assert after.circuit is circuit
    assert after.failures == failures
    assert after.opened_at == opened_at
    assert after.probing is probing
    assert (after.threshold, after.cooldown) == (start.threshold, start.cooldown)


# (name, state, now, allowed, circuit after, probing after)
ALLOW: list[tuple[str, Breaker, float, bool, Circuit, bool]] = [
    ("closed-allows", CLOSED, T0, True, Circuit.CLOSED, False),
    ("closed-below-threshold-allows", fail(2), T0, True, Circuit.CLOSED, False),
    ("open-refuses-right-after", OPEN, T0, False, Circuit.OPEN, False),
    ("open-refuses-before-cooldown", OPEN, T0 + 29.999, False, Circuit.OPEN, False),
    ("open-half-opens-at-cooldown", OPEN, T0 + 30, True, Circuit.HALF_OPEN, True),
    ("open-half-opens-after-cooldown", OPEN, T0 + 300, True, Circuit.HALF_OPEN, True),
    ("half-open-refuses-second-probe", HALF_OPEN_PROBING, T0 + 31, False, Circuit.HALF_OPEN, True),
    ("half-open-released-allows-one", HALF_OPEN_IDLE, T0 + 31, True, Circuit.HALF_OPEN, True),
]


@pytest.mark.parametrize(
    ("state", "now", "allowed", "circuit", "probing"),
    [pytest.param(*row[1:], id=row[0]) for row in ALLOW],
)
def test_allow(state: Breaker, now: float, allowed: bool, circuit: Circuit, probing: bool) -> None:
    ok, after = state.allow(now)
    assert ok is allowed
    assert after.circuit is circuit
    assert after.probing is probing
    assert after.opened_at == state.opened_at


def test_opens_after_exactly_threshold_consecutive_failures() -> None:
    b = Breaker(threshold=5, cooldown=10.0)
    for i in range(4):
        b = b.failure(T0 + i)
        assert b.circuit is Circuit.CLOSED
        assert b.allow(T0 + i)[0] is True
    b = b.failure(T0 + 4)
    assert b.circuit is Circuit.OPEN and b.opened_at == T0 + 4
    assert b.allow(T0 + 5)[0] is False


def test_failures_must_be_consecutive() -> None:
    b = fail(2).success()
    b = fail(2, b)
    assert b.circuit is Circuit.CLOSED and b.failures == 2


def test_exactly_one_probe_then_close() -> None:
    ok, b = OPEN.allow(T0 + 30)
    assert ok
    second, b = b.allow(T0 + 30.5)
    assert not second
    b = b.success()
    assert b.circuit is Circuit.CLOSED and b.failures == 0
    assert all(b.allow(T0 + 31 + i)[0] for i in range(10))


def test_failed_probe_restarts_the_cooldown_from_the_probe() -> None:
    _, b = OPEN.allow(T0 + 30)
    b = b.failure(T0 + 35)
    assert b.circuit is Circuit.OPEN and b.opened_at == T0 + 35
    assert b.allow(T0 + 64.9)[0] is False
    ok, b = b.allow(T0 + 65)
    assert ok and b.circuit is Circuit.HALF_OPEN


def test_released_probe_frees_the_slot_for_one_more() -> None:
    _, b = OPEN.allow(T0 + 30)
    b = b.release_probe()
    ok, b = b.allow(T0 + 31)
    assert ok
    assert b.allow(T0 + 31)[0] is False


def test_trip_opens_from_closed_with_no_failures() -> None:
    b = CLOSED.trip(T0)
    assert b.circuit is Circuit.OPEN
    assert b.allow(T0 + 1)[0] is False
    assert b.allow(T0 + 30)[0] is True


def test_allow_does_not_mutate() -> None:
    before = OPEN
    OPEN.allow(T0 + 100)
    assert before == OPEN and OPEN.circuit is Circuit.OPEN
