"""Provider throttling, as pure decisions (DESIGN.md §16).

Three facts slow a provider down, all shared by every instance on the store:

- a rate-limit reply (`421`, or `451 4.7.x` whose text says "rate" or "too many") marks the
  provider throttled for its `throttle_backoff`. It is the provider asking for less traffic,
  not failing: it does not count against the circuit breaker (which would take it out of
  the route for `cooldown` and probe it, while the provider said exactly when to come back);
- `max_rate`: the send slots of a fleet-wide GCRA (a leaky bucket kept as one number, the
  theoretical arrival time of the next message), one slot every 1/max_rate seconds;
- `max_connections`: leased slots, one per open upstream connection (store/base.py).

The reply's place in the transaction decides what it means for the message (relay.py):
before DATA nothing was sent, so the route may fail over or the queue wait; after the final
dot a `421` is the provider's answer to that message (deferred, never failed over — DESIGN
§4: the outcome after the dot belongs to the provider), and it still throttles the provider
for the messages that follow.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

RATE_WAIT = 1.0
"""The longest a message waits for its max_rate slot before the route moves on (relay mode:
the next provider or 451 4.4.1; queue mode: the entry is held until a slot is near)."""
CONNECTION_WAIT = 1.0
"""The longest a message waits for a max_connections slot, likewise."""

_RATE_WORDS = re.compile(r"\brate(?:[ -]?limit\w*|s|d)?\b|\bratelimit\w*|too many", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """One provider's throttling settings, as the route needs them."""

    max_rate: float | None = None
    """Messages per second, fleet-wide; None: unlimited."""
    max_connections: int | None = None
    """Open connections, fleet-wide; None: only pool_size bounds each instance."""
    backoff: float = 60.0
    """Seconds a rate-limit reply keeps every instance off the provider."""

    @property
    def interval(self) -> float | None:
        """Seconds between two send slots."""
        return 1.0 / self.max_rate if self.max_rate else None


def is_rate_limit(code: int, enhanced: str, text: str) -> bool:
    """Is this upstream reply a request to slow down? Any `421` (the provider closes the
    session: the clearest "not now" SMTP has), or a `451 4.7.x` (a policy deferral) whose
    text says rate or too many — a plain `451 4.3.0` or `451 4.7.1 greylisted` is not."""
    if code == 421:
        return True
    return code == 451 and enhanced.startswith("4.7.") and _RATE_WORDS.search(text) is not None


@dataclass(frozen=True, slots=True)
class Slot:
    """A GCRA decision: `granted` with the seconds to wait before sending in the slot, or
    not granted with the seconds until a slot could be granted. `tat` is what to store —
    when granted, or when it differs from the stored one (pulled back, see gcra) — (a
    backend that computes it on the server, Redis, hands back 0: callers never read it)."""

    granted: bool
    wait: float
    tat: float


def gcra(tat: float | None, now: float, interval: float, max_wait: float) -> Slot:
    """The next send slot of a provider whose previous slot ends at `tat` (the theoretical
    arrival time; None: never sent). Slots are `interval` apart, so any window of length W
    holds at most floor(W / interval) + 1 of them. A slot up to `max_wait` ahead is granted
    (the caller waits for it); a later one is not, and nothing is reserved.

    Slots `interval` apart never put `tat` more than max_wait + interval ahead of now. One
    further ahead was left by a longer interval (a reload raised max_rate): it is pulled
    back to that reach, and the refusal's `tat` carries it for the store to keep, so slots
    resume one new interval later rather than after the old one."""
    start = now if tat is None or tat < now else tat
    start = min(start, now + max_wait + interval)
    wait = start - now
    if wait > max_wait:
        return Slot(False, wait - max_wait, start)
    return Slot(True, wait, start + interval)


def blocked_until(throttled: dict[str, float], names: Iterable[str], now: float) -> float | None:
    """When the first of `names` stops being throttled, if every one of them is throttled
    now; None when one of them is usable."""
    untils = []
    for name in names:
        until = throttled.get(name)
        if until is None or until <= now:
            return None
        untils.append(until)
    return min(untils) if untils else None


def zone_route(providers: list[str], zone_providers: list[str] | None) -> list[str]:
    """A zone's route (`zones.Z.providers`): its own order and subset, else the top-level
    order. Names the config no longer knows (a reload removed one) are left out."""
    if zone_providers is None:
        return providers
    return [name for name in zone_providers if name in providers]
