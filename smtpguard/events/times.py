"""Event times as providers write them, read and checked for plausibility (DESIGN.md §18).

A time is shown in every record's history and console page, so one that is not a real
moment (`1e400`, NaN, the year 9999) is refused with `400` naming the field, before it can
reach the store. The window is a year either way of the receiving clock: a provider
delivers an event within days of it (retries included), and a record older than a year is
long past any `retention` an operator would keep, so nothing outside the window is an
event smtpguard can act on.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from smtpguard.policy.events import Malformed

WINDOW = 366 * 86400.0
"""An event time further than this from the receiving clock, either way, is refused."""


def epoch(value: Any, field: str) -> float:
    """Unix seconds, or an ISO 8601 time as Postmark, Resend and SNS write them."""
    if isinstance(value, bool):
        raise Malformed(f"{field} is not a number or an ISO 8601 time")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError):
            pass
    raise Malformed(f"{field} {str(value)[:64]!r} is not a number or an ISO 8601 time")


def event_time(value: Any, field: str, now: float) -> float:
    """The event's time; `now` (its arrival) when the provider gave none."""
    if value is None or value == "" or (isinstance(value, int | float) and value == 0):
        return now
    at = epoch(value, field)
    if not math.isfinite(at):
        raise Malformed(f"{field} is not a finite time")
    if abs(at - now) > WINDOW:
        raise Malformed(f"{field} is more than a year from now")
    return at
