"""A receiver's alert judged over a steady flow (DESIGN.md §21, docs/receivers.md "Alerts"):
1,000 sends an hour to the receiver, every 50th bouncing a minute after it was sent — a
steady 2%, under a 5% `bounce_rate` — read by the judge every 5 s for a day. Events count in
the window they arrive in, so early in each window the last one's bounces weighed against a
handful of sends: it warned (and `on_alert: pause` paused) in nearly every window. Judged
only once a window has `min_sends` sends, a steady rate under the rule never warns, and one
over it still warns in every window."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from smtpguard.config import loads
from smtpguard.policy.receivers import MIN_SENDS, AlertRule, AlertWindows
from tests.support import base_config

WINDOW = 3600.0
LAG = 60.0
START = WINDOW * 10


def warnings_in_a_day(rule: AlertRule, every: int) -> list[float]:
    """When (seconds into its window) each warning came, for bounces of one send in `every`."""
    windows = AlertWindows()
    sent, bounces, fired = 0, [], []
    next_send, now = START, START
    while now < START + 24 * WINDOW:
        while next_send <= now:
            sent += 1
            if sent % every == 0:
                bounces.append(next_send + LAG)
            next_send += WINDOW / 1000
        totals = {"sent": sent, "bounce": sum(1 for b in bounces if b <= now)}
        if windows.observe("acme", "microsoft", rule, totals, now):
            fired.append((now - START) % WINDOW)
        now += 5.0
    return fired


@pytest.mark.parametrize("min_sends", [1, MIN_SENDS])
def test_a_steady_rate_under_the_rule_never_warns(min_sends: int) -> None:
    fired = warnings_in_a_day(AlertRule(WINDOW, {"bounce_rate": 0.05}, min_sends), every=50)
    print(f"min_sends {min_sends}: {len(fired)} warnings in 24 windows, at {fired[:3]} s")
    if min_sends == 1:
        assert len(fired) >= 20  # what one send was enough for: the defect, kept in view
    else:
        assert fired == []


def test_a_steady_rate_over_the_rule_warns_in_every_window() -> None:
    fired = warnings_in_a_day(AlertRule(WINDOW, {"bounce_rate": 0.05}, MIN_SENDS), every=10)
    assert len(fired) == 24


def test_the_default_and_a_setting_of_min_sends(tmp: Path) -> None:
    def rule(alert: dict[str, object]) -> AlertRule | None:
        cfg = base_config(tmp, 25)
        cfg["receivers"] = {}
        cfg["zones"]["acme"]["receivers"] = {"microsoft": {"alert": alert}}
        return loads(yaml.safe_dump(cfg)).zones["acme"].receivers["microsoft"].shaping().alert

    default = rule({"bounce_rate": "5%"})
    assert default is not None and default.min_sends == MIN_SENDS
    low = rule({"bounce_rate": "5%", "min_sends": 1})
    assert low is not None and low.min_sends == 1
