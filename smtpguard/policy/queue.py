"""Store-and-forward scheduling (DESIGN.md §4a): backoff and priority lanes.

Lanes are served by class priority without starving the lower ones: every claim gives
each lane with work a share weighted by its priority (a lane of priority p weighs 4^-p,
so otp:transactional:bulk = 16:4:1), and at least one slot; what a lane cannot use goes
to the others in priority order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def backoff_delay(attempt: int, base: float, ceiling: float, jitter: float) -> float:
    """Exponential backoff with "equal jitter": half fixed, half random (`jitter` in [0,1)).

    attempt 1 → base, 2 → 2·base, …, capped at `ceiling`; never a tight loop.
    """
    raw = min(ceiling, base * 2.0 ** max(attempt - 1, 0))
    return raw / 2 + raw / 2 * jitter


def lane_quotas(free: int, lanes: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """Split `free` worker slots between lanes given as (name, priority), best first."""
    if free <= 0 or not lanes:
        return []
    ordered = sorted(lanes, key=lambda lane: lane[1])
    weights = [4.0**-priority for _, priority in ordered]
    total = sum(weights)
    quotas = [max(1, math.floor(free * w / total)) for w in weights]
    # Give any slots left by rounding to the best lanes, then trim from the worst.
    spare = free - sum(quotas)
    i = 0
    while spare > 0:
        quotas[i % len(quotas)] += 1
        spare -= 1
        i += 1
    i = len(quotas) - 1
    while sum(quotas) > free and i >= 0:
        if quotas[i] > 0:
            quotas[i] -= 1
        else:
            i -= 1
    return [(name, q) for (name, _), q in zip(ordered, quotas, strict=True) if q > 0]
