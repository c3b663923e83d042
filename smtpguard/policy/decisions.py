"""One decision vocabulary (DESIGN.md §14): what a submission or a queued delivery was decided
as, by the name /metrics labels it with, and the stat name the store counts it under.

Members are their strings (StrEnum), so every name stays byte-identical wherever it goes: logs,
metrics labels, stored counts, JSON. The one renaming left is on purpose and lives here: a
provider's `delivered` is decided as `relayed` (smtpguard handed it on; delivery is the
provider's to report) and counted as `sent`.
"""

from __future__ import annotations

from enum import StrEnum

from smtpguard.policy.outcome import Kind


class Decision(StrEnum):
    # Refused before the ledger (DESIGN.md §3 order).
    ZONE_GONE = "rejected:zone_gone"
    BARE_NEWLINE = "rejected:bare_newline"
    MALFORMED = "rejected:malformed"
    FROM = "rejected:from"
    KEY = "rejected:key"
    CLASS = "rejected:class"
    ENVELOPE = "rejected:envelope"
    # Answered by the ledger.
    DUPLICATE = "duplicate"
    REUSED = "reused"
    TOO_SOON = "too_soon"
    UNKNOWN_HELD = "unknown_held"
    FAILED_HELD = "failed_held"
    EXPIRED = "expired"
    IN_FLIGHT = "in_flight"
    CONTENDED = "contended"
    # Held by a control.
    PAUSED = "paused"
    CAP_HOUR = "cap_hour"
    CAP_MONTH = "cap_month"
    USER_CAP_HOUR = "user_cap_hour"
    USER_CAP_MONTH = "user_cap_month"
    # Relayed, or stopped on the way.
    RELAYED = "relayed"
    DEFERRED = "deferred"
    FAILED = "failed"
    UNKNOWN = "unknown"
    UNAVAILABLE = "unavailable"
    LEASE_LOST = "lease_lost"
    THROTTLED = "throttled"
    STORE_UNAVAILABLE = "store_unavailable"
    QUEUED = "queued"


_OF_KIND = {
    Kind.DELIVERED: Decision.RELAYED,
    Kind.DEFERRED: Decision.DEFERRED,
    Kind.FAILED: Decision.FAILED,
    Kind.UNKNOWN: Decision.UNKNOWN,
    Kind.UNAVAILABLE: Decision.UNAVAILABLE,
}

STAT_NAMES: dict[str, str] = {Decision.RELAYED: "sent"}
"""Stat names that differ from their decision's; every other decision is counted as itself."""


def relayed_as(kind: Kind) -> Decision:
    """The decision a relay's outcome is counted as."""
    return _OF_KIND[kind]


def stat_name(decision: str) -> str:
    """The name the store's per-zone stats count a decision under."""
    return STAT_NAMES.get(decision, decision)
