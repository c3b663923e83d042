"""When the supervisor starts a worker again after it died (DESIGN.md §17). Pure.

A worker that ran for a while and died (an OOM kill, a `kill -9`) is started again at
once: its leases cover what it had in flight, and every moment without it is capacity
lost. A worker that dies soon after each start (a store it cannot open, a bug at start)
is crash-looping: starting it again at once would spin a core and flood the log, so each
quick death doubles the wait, up to MAX_DELAY; one stable run forgives the streak.
"""

from __future__ import annotations

from dataclasses import dataclass

STABLE_AFTER = 10.0
"""Seconds of uptime after which a death is not part of a crash loop."""
FIRST_DELAY = 0.5
MAX_DELAY = 30.0


@dataclass(frozen=True)
class Restart:
    delay: float
    """Seconds to wait before starting the worker again."""
    streak: int
    """Quick deaths in a row, this one included (0: it had been stable)."""


def after_exit(uptime: float, streak: int) -> Restart:
    """The restart of a worker that ran `uptime` seconds, after `streak` quick deaths."""
    if uptime >= STABLE_AFTER:
        return Restart(0.0, 0)
    streak += 1
    return Restart(min(FIRST_DELAY * 2 ** (streak - 1), MAX_DELAY), streak)
