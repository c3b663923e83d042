"""Suppression lists kept in memory, checked against the store's change counters.

RCPT is the hottest store read: one per recipient, duplicates included. Each zone's list
and the global one are held here with the store's change counter for each; the counters
are read again at most once a second per zone, and a list is reloaded only when its
counter moved. So an `smtpguard suppress add|remove` made anywhere applies everywhere
within a second, and an address suppressed by this instance applies at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from smtpguard.policy.senders import normalize_address
from smtpguard.store import Store

REFRESH = 1.0
"""Seconds between two reads of a zone's change counters."""
MAX_CACHED = 100_000
"""A list longer than this is not held in memory; its lookups go to the store."""


class SuppressionCache:
    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self._lists: dict[str, tuple[int, frozenset[str] | None]] = {}
        self._checked: dict[str, float] = {}

    def invalidate(self, zone: str) -> None:
        """This instance changed the zone's list: read the counters on the next lookup."""
        self._checked.pop(zone, None)

    async def find(self, zone: str, address: str) -> str | None:
        """Which list holds the address: the zone's name, 'global', or None."""
        now = self.clock()
        if now - self._checked.get(zone, float("-inf")) >= REFRESH:
            own, shared = await self.store.suppression_versions(zone)
            await self._load(zone, own)
            await self._load("global", shared)
            self._checked[zone] = now
        addr = normalize_address(address)
        own_list, shared_list = self._lists[zone][1], self._lists["global"][1]
        if own_list is None or shared_list is None:
            return await self.store.suppressed(zone, address)
        if addr in own_list:
            return zone
        if addr in shared_list:
            return "global"
        return None

    async def _load(self, name: str, version: int) -> None:
        cached = self._lists.get(name)
        if cached is not None and cached[0] == version:
            return
        entries = await self.store.suppress_list(name)
        addresses = frozenset(e.address for e in entries) if len(entries) <= MAX_CACHED else None
        self._lists[name] = (version, addresses)
