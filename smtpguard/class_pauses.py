"""Paused message classes (DESIGN.md §16), as one instance sees them.

`pause ZONE --class C` writes a flag in the store; every instance sharing the store must
hold that class within a second. Each instance reads the whole (small) set of paused
classes at most every REFRESH seconds and answers from it in between, rather than reading a
flag per message or adding one to every reservation's atomic step: a pause is an operator's
switch with a one-second promise, not a race between two messages, and the hot path of a
fleet with nothing paused stays one store round trip per message. The zone's own kill
switch stays inside the reservation, as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from smtpguard.policy import ledger
from smtpguard.store import Store, StoreUnavailable

REFRESH = 0.5
"""Seconds a read of the paused classes is answered from: with the store's round trip, a
pause holds on every instance well within the 1 s DESIGN.md §16 promises."""

HOLD = 30.0
"""Seconds a queued entry of a paused class is given back for. Not the zone pause's one
second: a paused class is typically a flood (a bulk job gone wrong), and re-claiming every
held entry every second cost two record writes per entry per second for the whole backlog.
`resume --class` makes the held entries due at once (wake_held), so resuming stays quick."""


class ClassPauses:
    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self._pairs: frozenset[tuple[str, str]] = frozenset()
        self._read_at: float | None = None
        self._lock = asyncio.Lock()
        self._reads = 0
        """Reads ended: a session that waited on the lock knows whether one ended meanwhile
        (also one already under way when it came)."""
        self._failure: StoreUnavailable | None = None
        """How the last read ended, when it failed."""

    async def paused(self) -> frozenset[tuple[str, str]]:
        """Every (zone, class) paused, at most REFRESH seconds old. A failed read raises
        StoreUnavailable, as the reservation it precedes would."""
        if self._read_at is not None and self._clock() - self._read_at < REFRESH:
            return self._pairs
        seen = self._reads
        async with self._lock:
            # One read for all the sessions that found the copy stale together; when it
            # failed, they fail with it rather than each waiting out a store timeout in turn.
            if self._reads != seen and self._failure is not None:
                raise StoreUnavailable(str(self._failure))
            if self._read_at is None or self._clock() - self._read_at >= REFRESH:
                started = self._clock()
                self._failure = None
                try:
                    pairs = frozenset(await self._store.paused_classes())
                except StoreUnavailable as e:
                    self._failure = e
                    raise
                finally:
                    self._reads += 1
                self._pairs, self._read_at, self._failure = pairs, started, None
        return self._pairs

    async def is_paused(self, zone: str, message_class: str) -> bool:
        return (zone, message_class) in await self.paused()


async def wake_held(store: Store, zone: str, message_class: str | None, now: float) -> int:
    """After `resume ZONE --class C`: the class's entries held while it was paused made due
    now, rather than when their hold ends (None: every class's, after `resume ZONE
    --receiver R`). Idempotent (an entry woken or claimed meanwhile is left alone); returns
    how many were woken."""
    woken = 0
    for entry in await store.queue_entries(zone):
        if (message_class is not None and entry.lane != message_class) or entry.claimed:
            continue
        rec = await store.get(zone, entry.key)
        new = ledger.wake(rec, now, HOLD) if rec is not None else None
        if rec is not None and new is not None and await store.requeue(new, rec.version, now) is None:
            woken += 1
    return woken
