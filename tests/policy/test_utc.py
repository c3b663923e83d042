"""The two spellings of a UTC moment (policy/utc.py): the same text for every real time, and
apart only where each must keep its own (a year before 1000)."""

from __future__ import annotations

import pytest

from smtpguard.policy.utc import iso_z, stamp
from smtpguard.verdicts.model import iso_utc


@pytest.mark.parametrize(
    ("epoch", "text"),
    [
        (0.0, "1970-01-01T00:00:00Z"),
        (1_000_000_000.9999, "2001-09-09T01:46:40Z"),  # the fraction is dropped, not rounded
        (-1.0, "1969-12-31T23:59:59Z"),
        (253_402_300_799.0, "9999-12-31T23:59:59Z"),
    ],
)
def test_both_spellings_agree_on_real_times(epoch: float, text: str) -> None:
    assert iso_z(epoch) == stamp(epoch) == iso_utc(epoch) == text


def test_a_year_before_1000_keeps_each_spelling() -> None:
    year_385 = -50_000_000_000.0
    assert iso_z(year_385) == "0385-07-25T07:06:40Z"
    assert stamp(year_385) == "385-07-25T07:06:40Z"
