"""Provider throttling decisions (DESIGN.md §16), without sockets or clocks."""

from __future__ import annotations

import pytest

from smtpguard.policy.throttle import ProviderLimits, blocked_until, gcra, is_rate_limit, zone_route
from smtpguard.units import parse_rate


@pytest.mark.parametrize(
    ("code", "enhanced", "text", "expected"),
    [
        (421, "4.7.0", "rate limited", True),
        (421, "4.3.2", "Service shutting down", True),  # any 421: the provider closes
        (451, "4.7.0", "Rate limit exceeded, slow down", True),
        (451, "4.7.1", "Too many messages, try later", True),
        (451, "4.7.0", "rate-limited", True),
        (451, "4.7.0", "ratelimit hit", True),
        (451, "4.7.0", "sending rates exceeded", True),
        (451, "4.7.1", "greylisted, come back later", False),
        (451, "4.7.0", "accurate reply for a generated message", False),  # not the word
        (451, "4.3.0", "too many concurrent sessions", False),  # not a 4.7.x policy reply
        (450, "4.7.0", "rate limited", False),
        (452, "4.5.3", "too many recipients", False),
        (550, "5.7.1", "rate limited", False),
        (250, "2.0.0", "ok", False),
    ],
)
def test_which_replies_are_rate_limits(code: int, enhanced: str, text: str, expected: bool) -> None:
    assert is_rate_limit(code, enhanced, text) is expected


def test_gcra_spaces_slots_and_refuses_past_max_wait() -> None:
    s = gcra(None, 100.0, 0.5, 1.0)
    assert s.granted and s.wait == 0 and s.tat == 100.5
    s = gcra(s.tat, 100.0, 0.5, 1.0)
    assert s.granted and s.wait == 0.5 and s.tat == 101.0
    s = gcra(s.tat, 100.0, 0.5, 1.0)
    assert s.granted and s.wait == 1.0 and s.tat == 101.5
    refused = gcra(s.tat, 100.0, 0.5, 1.0)
    assert not refused.granted and refused.wait == 0.5 and refused.tat == 101.5
    # An idle provider does not save up a burst: the next slot starts now.
    idle = gcra(101.5, 500.0, 0.5, 1.0)
    assert idle.granted and idle.wait == 0 and idle.tat == 500.5


def test_gcra_never_puts_more_than_rate_plus_one_in_a_second() -> None:
    interval, tat, now = 0.1, None, 0.0
    sends: list[float] = []
    for i in range(200):
        now = i * 0.013  # callers arriving faster than the rate
        s = gcra(tat, now, interval, 1.0)
        if s.granted:
            tat = s.tat
            sends.append(now + s.wait)
    for start in sends:
        assert sum(1 for t in sends if start <= t <= start + 1.0) <= 11


def test_blocked_until_needs_every_provider_throttled() -> None:
    throttled = {"primary": 160.0, "standby": 130.0}
    assert blocked_until(throttled, ["primary", "standby"], 100.0) == 130.0
    assert blocked_until(throttled, ["primary", "other"], 100.0) is None
    assert blocked_until(throttled, ["primary"], 170.0) is None
    assert blocked_until(throttled, [], 100.0) is None


def test_zone_route() -> None:
    assert zone_route(["primary", "standby"], None) == ["primary", "standby"]
    assert zone_route(["primary", "standby"], ["standby", "primary"]) == ["standby", "primary"]
    assert zone_route(["primary", "standby"], ["standby", "gone"]) == ["standby"]


def test_limits_interval() -> None:
    assert ProviderLimits(max_rate=10.0).interval == 0.1
    assert ProviderLimits().interval is None


@pytest.mark.parametrize(
    ("text", "per_second"), [("10/s", 10.0), ("600/m", 10.0), ("36000/h", 10.0), (" 0.5 / s ", 0.5)]
)
def test_rates(text: str, per_second: float) -> None:
    assert parse_rate(text) == pytest.approx(per_second)


@pytest.mark.parametrize("bad", ["10", "10/d", "fast", "0/s", "-1/s", "/s", 10, True, None])
def test_bad_rates(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_rate(bad)


def test_gcra_after_max_rate_was_raised_waits_one_new_interval_not_the_old_one() -> None:
    """A reload raised max_rate from 1/h to 10/s: the stored arrival time is an hour ahead,
    which no sequence of 0.1 s slots can produce. It is pulled back to the furthest a
    0.1 s sequence reaches (max_wait + interval ahead), and that is stored even though the
    slot is refused, so slots resume one new interval later, not an hour later."""
    now = 1000.0
    stale = now + 3600.0
    refused = gcra(stale, now, 0.1, 1.0)
    assert not refused.granted and refused.tat == now + 1.1 and round(refused.wait, 6) == 0.1
    granted = gcra(refused.tat, now + 0.1, 0.1, 1.0)
    assert granted.granted and round(granted.wait, 6) == 1.0
    # A sequence the interval could have produced is never pulled back: no extra slot.
    consistent = gcra(now + 1.05, now, 0.1, 1.0)
    assert not consistent.granted and consistent.tat == now + 1.05
