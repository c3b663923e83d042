"""Durations and sizes as an operator writes them in the YAML config (DESIGN.md §9)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smtpguard.units import format_duration, parse_duration, parse_size


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        pytest.param(90, 90.0, id="int-is-seconds"),
        pytest.param(1.5, 1.5, id="float-is-seconds"),
        pytest.param(0, 0.0, id="zero"),
        pytest.param("90s", 90.0, id="s"),
        pytest.param("500ms", 0.5, id="ms"),
        pytest.param("10m", 600.0, id="m"),
        pytest.param("1h", 3600.0, id="h"),
        pytest.param("30d", 2_592_000.0, id="d"),
        pytest.param("2w", 1_209_600.0, id="w"),
        pytest.param("1.5h", 5400.0, id="fraction"),
        pytest.param("  5 m ", 300.0, id="spaces"),
        pytest.param("0s", 0.0, id="zero-string"),
    ],
)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("", "is not a duration", id="empty"),
        pytest.param("10", "is not a duration", id="string-without-unit"),
        pytest.param("10x", "is not a duration", id="unknown-unit"),
        pytest.param("10M", "is not a duration", id="upper-case-unit"),
        pytest.param("-5s", "is not a duration", id="negative-string"),
        pytest.param("1e3s", "is not a duration", id="exponent"),
        pytest.param("5 s s", "is not a duration", id="trailing-garbage"),
        pytest.param(-1, "cannot be negative", id="negative-number"),
        pytest.param(True, "expected a duration", id="bool"),
        pytest.param(None, "expected a duration", id="none"),
        pytest.param([30], "expected a duration", id="list"),
        pytest.param(float("nan"), "finite", id="nan"),
        pytest.param(float("inf"), "finite", id="inf"),
        pytest.param("9" * 400 + "s", "finite", id="overflows-to-inf"),
    ],
)
def test_parse_duration_errors(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_duration(value)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        pytest.param(1024, 1024, id="int-is-bytes"),
        pytest.param("1024", 1024, id="string-number"),
        pytest.param("10B", 10, id="B"),
        pytest.param("64KB", 64_000, id="KB"),
        pytest.param("25MB", 25_000_000, id="MB"),
        pytest.param("2GB", 2_000_000_000, id="GB"),
        pytest.param("64KiB", 65_536, id="KiB"),
        pytest.param("25MiB", 26_214_400, id="MiB"),
        pytest.param("1GiB", 1_073_741_824, id="GiB"),
        pytest.param("25 mb", 25_000_000, id="lower-case-and-space"),
        pytest.param("1.5KB", 1_500, id="fraction"),
        pytest.param(0, 0, id="zero"),
    ],
)
def test_parse_size(value: object, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("", "is not a size", id="empty"),
        pytest.param("25XB", "is not a size", id="unknown-unit"),
        pytest.param("25 M", "is not a size", id="bare-m"),
        pytest.param("-5MB", "is not a size", id="negative-string"),
        pytest.param("MB", "is not a size", id="no-number"),
        pytest.param(-1, "cannot be negative", id="negative-int"),
        pytest.param(True, "expected a size", id="bool"),
        pytest.param(1.5, "expected a size", id="float"),
        pytest.param(None, "expected a size", id="none"),
        pytest.param("9" * 400 + "GB", "too large", id="overflows-to-inf"),
    ],
)
def test_parse_size_errors(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        pytest.param(0, "0s", id="zero"),
        pytest.param(1, "1s", id="one-second"),
        pytest.param(59, "59s", id="seconds"),
        pytest.param(60, "1m", id="minute"),
        pytest.param(90, "90s", id="not-whole-minutes"),
        pytest.param(600, "10m", id="minutes"),
        pytest.param(3600, "1h", id="hour"),
        pytest.param(5400, "90m", id="not-whole-hours"),
        pytest.param(86400, "1d", id="day"),
        pytest.param(30 * 86400, "30d", id="retention"),
        pytest.param(14 * 86400, "2w", id="weeks"),
        pytest.param(0.5, "0.5s", id="half-second"),
        pytest.param(0.001, "0.001s", id="millisecond"),
        pytest.param(0.00001, "0.00001s", id="no-exponent"),
        pytest.param(123456.5, "123456.5s", id="not-rounded"),
        pytest.param(1.2345678, "1.2345678s", id="all-digits"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(
        st.integers(min_value=0, max_value=10**9),
        st.floats(min_value=0, max_value=1e9, allow_nan=False, allow_infinity=False),
    )
)
def test_format_duration_reads_back_exactly(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds
