"""Answers kept for their TTL and shared while under way: what RCPT needs of DNS.

Used by the recipient-domain check (§12) and the receiver lookup (§21): a burst of RCPTs to
one domain costs one lookup, concurrent RCPTs for a domain not yet known share one, and a
client that hangs up cancels only its own wait, never the lookup others wait on. Bounded in
entries so that RCPTs to random domains cannot grow memory without limit.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

V = TypeVar("V")

MAX_ENTRIES = 10_000
"""Names kept at once; the oldest go first."""


class SharedLookups(Generic[V]):
    def __init__(
        self,
        look_up: Callable[[str], Awaitable[tuple[V, float]]],
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self._look_up = look_up
        """name → (answer, seconds it may be kept); bounded in time by the caller."""
        self.clock = clock
        self.max_entries = max_entries
        self._known: OrderedDict[str, tuple[V, float]] = OrderedDict()
        self._asking: dict[str, asyncio.Task[V]] = {}
        """The lookup under way per name; the dict holds the task's only strong reference."""
        self.lookups = 0
        """Names looked up (not served from the cache): for tests and the bench."""

    def cached(self, name: str) -> V | None:
        known = self._known.get(name)
        return known[0] if known is not None and known[1] > self.clock() else None

    def kept(self, name: str) -> V | None:
        """The answer kept for `name`, expired or not (None: none kept): what a caller whose
        lookup failed may fall back on (RFC 8767's stale answer)."""
        known = self._known.get(name)
        return known[0] if known is not None else None

    async def get(self, name: str) -> V:
        known = self._known.get(name)
        if known is not None and known[1] > self.clock():
            return known[0]
        return await asyncio.shield(self._pending(name))

    def start(self, name: str) -> None:
        """Begin the lookup of `name` unless it is known or under way; a later get() joins
        it. For a caller that has another wait to make first: the two overlap."""
        if self.cached(name) is None:
            self._pending(name)

    def _pending(self, name: str) -> asyncio.Task[V]:
        pending = self._asking.get(name)
        if pending is None:
            # The lookup is the shared task's, not the first caller's: a client that hangs
            # up (aiosmtpd cancels its session) cancels only its own wait, through the
            # shield, never the lookup the other sessions for this name are waiting on.
            pending = asyncio.get_running_loop().create_task(self._settle(name))
            # Retrieved even when every waiter went away, so a failure is never "unretrieved".
            pending.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._asking[name] = pending
        return pending

    async def _settle(self, name: str) -> V:
        self.lookups += 1
        try:
            value, ttl = await self._look_up(name)
        finally:
            del self._asking[name]
        self._known[name] = (value, self.clock() + ttl)
        self._known.move_to_end(name)
        while len(self._known) > self.max_entries:
            self._known.popitem(last=False)
        return value
