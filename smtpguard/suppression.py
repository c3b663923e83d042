"""Suppression lists kept in memory, checked against the store's change counters.

RCPT is the hottest store read: one per recipient, duplicates included. Each zone's list
and the global one are held here with the store's change counter for each; the counters
are read again at most once a second per zone, and a list is reloaded only when its
counter moved. So an `smtpguard suppress add|remove` made anywhere applies everywhere
within a second, and an address suppressed by this instance applies at once.

Entries and recipients are compared by suppression_key (case-folded, local part included;
see policy/senders.py for why), so `Bob@x` on the list stops `bob@x`. The folding happens
here, on load, so entries stored before it (the stores keep the local part as written)
match too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from smtpguard.policy.senders import suppression_key
from smtpguard.store import Store

REFRESH = 1.0
"""Seconds between two reads of a zone's change counters."""
MAX_CACHED = 100_000
"""A list longer than this is not held in memory; its lookups go to the store."""


OVERSIZE_RECHECK = 60.0
"""An oversized list is not loaded again for this long, however often its counter moves."""


class SuppressionCache:
    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self._lists: dict[str, tuple[int, frozenset[str] | None, float]] = {}
        """list name → (change counter, addresses or None when oversized, loaded at)"""
        self._checked: dict[str, float] = {}
        self._generation: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def invalidate(self, zone: str) -> None:
        """This instance changed the zone's list: read the counters on the next lookup,
        even if a refresh that started before the change is still running."""
        self._checked.pop(zone, None)
        self._generation[zone] = self._generation.get(zone, 0) + 1

    async def find(self, zone: str, address: str) -> str | None:
        """Which list holds the address: the zone's name, 'global', or None."""
        if self.clock() - self._checked.get(zone, float("-inf")) >= REFRESH:
            # One refresh per zone at a time; lookups arriving meanwhile wait for it.
            async with self._locks.setdefault(zone, asyncio.Lock()):
                now = self.clock()
                if now - self._checked.get(zone, float("-inf")) >= REFRESH:
                    generation = self._generation.get(zone, 0)
                    own, shared = await self.store.suppression_versions(zone)
                    await self._load(zone, own, now)
                    await self._load("global", shared, now)
                    if self._generation.get(zone, 0) == generation:
                        self._checked[zone] = now
        own_list, shared_list = self._lists[zone][1], self._lists["global"][1]
        if own_list is None or shared_list is None:
            # The store's own lookup: it matches the local part exactly as stored.
            return await self.store.suppressed(zone, address)
        addr = suppression_key(address)
        if addr in own_list:
            return zone
        if addr in shared_list:
            return "global"
        return None

    async def _load(self, name: str, version: int, now: float) -> None:
        cached = self._lists.get(name)
        if cached is not None:
            if cached[0] == version:
                return
            if cached[1] is None and now - cached[2] < OVERSIZE_RECHECK:
                return  # still served from the store; do not reload a huge list every second
        entries = await self.store.suppress_list(name)
        addresses = None
        if len(entries) <= MAX_CACHED:
            addresses = frozenset(suppression_key(e.address) for e in entries)
        self._lists[name] = (version, addresses, now)
