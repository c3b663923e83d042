"""State stores: the interface in base.py, backends beside it."""

from smtpguard.store.base import (
    CapUsage,
    Conflict,
    Paused,
    Reserved,
    ReserveResult,
    Store,
    StoreUnavailable,
    Suppression,
    store_from_url,
)

__all__ = [
    "CapUsage",
    "Conflict",
    "Paused",
    "ReserveResult",
    "Reserved",
    "Store",
    "StoreUnavailable",
    "Suppression",
    "store_from_url",
]
