"""State stores: the interface in base.py, backends beside it."""

from smtpguard.store.base import (
    HELD,
    CapUsage,
    CircuitState,
    Claimed,
    Conflict,
    Paused,
    ProbeState,
    QueuedMessage,
    QueueEntry,
    Reserved,
    ReserveResult,
    Store,
    StoreMissing,
    StoreUnavailable,
    Suppression,
    store_from_url,
)

__all__ = [
    "HELD",
    "CapUsage",
    "CircuitState",
    "Claimed",
    "Conflict",
    "Paused",
    "ProbeState",
    "QueueEntry",
    "QueuedMessage",
    "ReserveResult",
    "Reserved",
    "Store",
    "StoreMissing",
    "StoreUnavailable",
    "Suppression",
    "store_from_url",
]
