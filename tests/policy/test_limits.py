"""Plans, caps and windows (DESIGN.md §5 plan table; §3 hourly/monthly cap rows)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smtpguard.policy import limits
from smtpguard.policy.limits import PLANS, CapReached, Caps, Plan


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


# DESIGN.md §5, copied row by row.
PLAN_TABLE = [
    ("free", False, 0, 0),
    ("solo", True, 2_500, 20),
    ("starter", True, 5_000, 40),
    ("business", True, 12_000, 60),
    ("agency", True, 20_000, 60),
    ("unlimited", True, 100_000, 300),
]


@pytest.mark.parametrize(
    ("plan", "send_as", "monthly", "hourly"), [pytest.param(*row, id=row[0]) for row in PLAN_TABLE]
)
def test_plan_preset_matches_design(plan: str, send_as: bool, monthly: int, hourly: int) -> None:
    assert PLANS[plan] == Plan(send_as=send_as, caps=Caps(hourly=hourly, monthly=monthly))
    assert limits.caps_for(plan, None, None) == Caps(hourly=hourly, monthly=monthly)


def test_no_plans_beyond_the_design_table() -> None:
    assert set(PLANS) == {row[0] for row in PLAN_TABLE}


@pytest.mark.parametrize(
    ("plan", "hourly", "monthly", "expected"),
    [
        pytest.param("solo", 5, None, Caps(hourly=5, monthly=2_500), id="hourly-only"),
        pytest.param("solo", None, 100, Caps(hourly=20, monthly=100), id="monthly-only"),
        pytest.param("business", 1, 2, Caps(hourly=1, monthly=2), id="both"),
        pytest.param("free", 10, 1_000, Caps(hourly=10, monthly=1_000), id="free-raised"),
        pytest.param("unlimited", 0, 0, Caps(hourly=0, monthly=0), id="zero-is-an-override-not-default"),
    ],
)
def test_explicit_caps_override_the_preset(
    plan: str, hourly: int | None, monthly: int | None, expected: Caps
) -> None:
    assert limits.caps_for(plan, hourly, monthly) == expected


@pytest.mark.parametrize(
    ("moment", "month"),
    [
        pytest.param("2024-01-31T23:59:59.999", "2024-01", id="last-ms-of-january"),
        pytest.param("2024-02-01T00:00:00", "2024-02", id="first-instant-of-february"),
        pytest.param("2024-02-29T12:00:00", "2024-02", id="leap-day"),
        pytest.param("2024-12-31T23:59:59", "2024-12", id="last-second-of-year"),
        pytest.param("2025-01-01T00:00:00", "2025-01", id="new-year-utc"),
        pytest.param("1970-01-01T00:00:00", "1970-01", id="epoch"),
    ],
)
def test_month_of_is_the_utc_calendar_month(moment: str, month: str) -> None:
    assert limits.month_of(ts(moment)) == month


def test_month_of_ignores_the_local_timezone(monkeypatch: pytest.MonkeyPatch) -> None:
    # 00:30 UTC on Feb 1st is still January in New York; the cap month is UTC's.
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert limits.month_of(ts("2024-02-01T00:30:00")) == "2024-02"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_cap_check_windows() -> None:
    now = ts("2024-03-01T00:10:00")
    caps = Caps(hourly=20, monthly=2_500)
    check = limits.cap_check("acme", caps, "tok-1", now)
    assert check.zone == "acme" and check.caps == caps and check.token == "tok-1"
    assert check.now == now
    assert check.hour_start == now - 3600
    assert check.month == "2024-03", "the sliding hour may reach into February; the month does not"


@pytest.mark.parametrize(
    ("oldest", "now", "free_at"),
    [
        pytest.param(1_000.0, 2_000.0, 4_600.0, id="oldest-send-leaves-window"),
        pytest.param(None, 2_000.0, 5_600.0, id="no-send-known"),
    ],
)
def test_hour_free_at(oldest: float | None, now: float, free_at: float) -> None:
    assert limits.hour_free_at(oldest, now) == free_at


def test_hourly_cap_reply_is_451_470_with_the_time_a_slot_frees() -> None:
    free_at = ts("2024-03-01T10:42:07")
    reply = limits.cap_reply("acme", CapReached("hour", 20, free_at))
    assert (reply.code, reply.enhanced) == (451, "4.7.0")
    assert "2024-03-01T10:42:07Z" in reply.text
    assert "20" in reply.text and "acme" in reply.text
    assert reply.temporary


def test_monthly_cap_reply_is_550_570_naming_the_cap() -> None:
    reply = limits.cap_reply("acme", CapReached("month", 2_500))
    assert (reply.code, reply.enhanced) == (550, "5.7.0")
    assert "Monthly cap of 2500" in reply.text and "acme" in reply.text
    assert reply.permanent


@given(st.lists(st.floats(min_value=0, max_value=4_102_444_800), min_size=1, max_size=50))
def test_month_of_matches_the_calendar_in_any_order(moments: list[float]) -> None:
    """month_of keeps the last month's bounds; in any order of calls it is still the calendar."""
    for t in moments:
        assert limits.month_of(t) == datetime.fromtimestamp(t, UTC).strftime("%Y-%m")


@pytest.mark.parametrize("month", range(1, 13))
def test_month_of_turns_at_midnight_utc_on_the_first(month: int) -> None:
    first = datetime(2027, month, 1, tzinfo=UTC).timestamp()
    before = datetime.fromtimestamp(first - 0.001, UTC).strftime("%Y-%m")
    assert limits.month_of(first + 0.001) == f"2027-{month:02d}"
    assert limits.month_of(first - 0.001) == before
    assert limits.month_of(first) == f"2027-{month:02d}"
