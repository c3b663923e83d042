"""Cap alerts (DESIGN.md §16, `alert_at`): which shares of a cap have been crossed, and in
which window a warning counts as already given.

One warning per threshold per window: the hourly cap's window is the clock hour (UTC) the
crossing is seen in, the monthly cap's the calendar month. The hourly cap itself slides, so
usage may dip under a share and cross it again within the hour; that is still one warning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from smtpguard.policy.limits import HOUR, month_of

Window = Literal["hour", "month"]


def used_ratio(used: int, cap: int) -> float | None:
    """The share of the cap used; None for a zero cap (nothing may be sent: no share)."""
    if cap <= 0:
        return None
    return min(used / cap, 1.0)


def window_id(window: Window, now: float) -> str:
    if window == "hour":
        return f"h{int(now // HOUR)}"
    return month_of(now)


@dataclass(slots=True)
class AlertLedger:
    """The warnings this instance has given, per (zone, window, window id, threshold)."""

    given: dict[tuple[str, Window], tuple[str, set[float]]] = field(default_factory=dict)

    def newly_crossed(
        self, zone: str, window: Window, ratio: float, thresholds: list[float], now: float
    ) -> list[float]:
        """The thresholds `ratio` reaches that were not warned about in this window yet;
        they count as warned from now on."""
        wid = window_id(window, now)
        current = self.given.get((zone, window))
        if current is None or current[0] != wid:
            # A new window: the old one's warnings are forgotten (bounded memory).
            current = (wid, set())
            self.given[(zone, window)] = current
        fresh = [t for t in thresholds if ratio >= t and t not in current[1]]
        current[1].update(fresh)
        return fresh

    def forget(self, gone: Callable[[str], bool]) -> None:
        """Forget the zones `gone` says were removed."""
        for key in [k for k in self.given if gone(k[0])]:
            del self.given[key]
