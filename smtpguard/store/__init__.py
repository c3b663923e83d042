"""State stores: the interface in base.py, backends beside it."""

from smtpguard.store.base import (
    HELD,
    CapUsage,
    CircuitState,
    Claimed,
    Conflict,
    Paused,
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
