"""Store-and-forward scheduling (DESIGN.md §4a): backoff and priority lanes.

Lanes are served by class priority without starving the lower ones: each free worker slot
goes to a lane drawn with weight 4^-priority (otp:transactional:bulk = 16:4:1), and what a
lane cannot use goes to the others in priority order.
"""

from __future__ import annotations

from collections.abc import Sequence

from smtpguard.policy.ledger import Record, State

HELD = 1e18
"""A due time that never comes: the entry stays (its body kept) until an operator acts."""


def queue_due(rec: Record) -> float | None:
    """Where a store-and-forward entry goes after a write: off the queue once delivered or
    expired; kept but never due while unknown or failed (an operator may `resolve` or
    `release` it, and the message must still be there to send); else due at its next try."""
    if rec.state in (State.DELIVERED, State.EXPIRED):
        return None
    if rec.state in (State.UNKNOWN, State.FAILED):
        return HELD
    return rec.next_attempt_at if rec.next_attempt_at is not None else rec.updated_at


def backoff_delay(attempt: int, base: float, ceiling: float, jitter: float) -> float:
    """Exponential backoff with "equal jitter": half fixed, half random (`jitter` in [0,1)).

    attempt 1 → base, 2 → 2·base, …, capped at `ceiling`; never a tight loop.
    """
    raw = min(ceiling, base * 2.0 ** max(attempt - 1, 0))
    return raw / 2 + raw / 2 * jitter


def lane_quotas(free: int, lanes: Sequence[tuple[str, int]], draws: Sequence[float]) -> list[tuple[str, int]]:
    """Split `free` worker slots between lanes given as (name, priority).

    Each slot goes to a lane drawn at random with weight 4^-priority (`draws` are uniform
    numbers in [0,1), one per slot), so under saturation bulk still gets about 1 slot in 21
    and is never starved. Every lane is returned, best first, zero quotas included: the
    store gives slots a lane cannot use to the lanes after it, in this order.
    """
    ordered = sorted(lanes, key=lambda lane: lane[1])
    if free <= 0 or not ordered:
        return []
    weights = [4.0**-priority for _, priority in ordered]
    total = sum(weights)
    counts = [0] * len(ordered)
    for u in draws[:free]:
        point, acc = u * total, 0.0
        for i, w in enumerate(weights):
            acc += w
            if point < acc or i == len(weights) - 1:
                counts[i] += 1
                break
    return [(name, n) for (name, _), n in zip(ordered, counts, strict=True)]
