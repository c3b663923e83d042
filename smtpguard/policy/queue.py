"""Store-and-forward scheduling (DESIGN.md §4a): backoff, priority lanes and the gate a
claimed entry passes before it is relayed.

Lanes are served by class priority without starving the lower ones: each free worker slot
goes to a lane drawn with weight 4^-priority (otp:transactional:bulk = 16:4:1), and what a
lane cannot use goes to the others in priority order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from smtpguard.policy.ledger import Record, State
from smtpguard.policy.limits import CapReached

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


HOLD_PAUSED = 1.0
"""A paused zone's lane is looked at again this often, so `resume` takes effect quickly."""
HOLD_ZONE_GONE = 60.0
"""An entry of a zone a reload removed waits this long, unattempted, for the zone to return."""
HOLD_MONTH_CAPPED = 3600.0
"""A monthly cap frees no slot at a known time: look again in an hour (max_age may expire it)."""


class Look(Enum):
    """A fact the gate needs next, in the order it asks for them. The cap is last because
    looking at it spends a unit when the entry may go."""

    PAUSE = "pause"
    CLASS = "class"
    THROTTLE = "throttle"
    CAP = "cap"


@dataclass(frozen=True, slots=True)
class Hold:
    """Give the entry back unsent, no attempt counted, until `until`."""

    until: float
    reason: str


@dataclass(frozen=True, slots=True)
class Go:
    """Relay the entry now (its cap unit is taken)."""


GO = Go()


@dataclass(frozen=True, slots=True)
class GateFacts:
    """What the worker has looked up so far about one claimed entry; a fact not yet looked at
    is None (the look flags for throttle and cap, whose answer may itself be None)."""

    now: float
    expires_at: float | None
    zone_known: bool
    class_hold: float
    """How long a paused class's entry is given back for (class_pauses.HOLD)."""
    paused: bool | None = None
    class_paused: bool | None = None
    throttle_looked: bool = False
    throttled_until: float | None = None
    cap_looked: bool = False
    cap: CapReached | None = None


def gate(f: GateFacts) -> Go | Hold | Look:
    """The hold ladder of a claimed entry (DESIGN.md §4a, §16): zone gone → zone paused →
    class paused → route throttled → capped, the first that applies holds it for its own
    time; a fact not yet known is asked for, so no later look (and no cap unit) is spent on
    an entry an earlier rung holds."""
    if not f.zone_known:
        return Hold(f.now + HOLD_ZONE_GONE, "zone_gone")
    if f.paused is None:
        return Look.PAUSE
    if f.paused:
        return Hold(f.now + HOLD_PAUSED, "paused")
    if f.class_paused is None:
        return Look.CLASS
    if f.class_paused:
        # Held until resume wakes it, but never past its max_age: it must expire on time.
        until = f.now + f.class_hold
        return Hold(until if f.expires_at is None else min(until, f.expires_at), "class_paused")
    if not f.throttle_looked:
        return Look.THROTTLE
    if f.throttled_until is not None:
        # Every provider of the zone's route asked to slow down: wait, unattempted.
        return Hold(f.throttled_until, "throttled")
    if not f.cap_looked:
        return Look.CAP
    if f.cap is not None:
        return Hold(f.cap.free_at or f.now + HOLD_MONTH_CAPPED, "capped")
    return GO
