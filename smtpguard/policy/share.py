"""Which provider carries a message when standbys take a steady share (DESIGN.md §12).

A standby that only ever sees mail during an outage has no sending reputation and no
proof that it works; `share: 0.02` sends it 2% of relayed mail while it is ready. The share
is chosen by a hash of zone and event key, never at random, so a retry of the same event
(after a 4xx, or a client that timed out) takes the same provider as its first attempt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    share: float
    eligible: bool
    """Ready by its last probe and its circuit closed."""


def slot(zone: str, key: str) -> float:
    """A point in [0, 1) fixed by zone and key, uniform over keys."""
    digest = hashlib.blake2b(f"{zone}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def shared_provider(point: float, candidates: Sequence[Candidate]) -> str | None:
    """The standby whose share the point falls in, if it may take mail now; None for the
    normal route. Each standby owns a fixed interval of [0, 1) whether eligible or not, so
    one standby going unready does not move another's keys."""
    start = 0.0
    for c in candidates:
        end = start + c.share
        if start <= point < end:
            return c.name if c.eligible else None
        start = end
    return None
