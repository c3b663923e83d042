"""Failures the store could not record, remembered in the process until it can.

AUTH counts failures in the store so that every instance sees them. When the store answers
reads but refuses writes (a demoted primary, Redis below `min-replicas-to-write`, a full
`noeviction` instance), a wrong password would be answered `451` without being counted and
the right one `235`: unlimited guesses, each telling whether it was right. Remembering the
unrecorded failures here and adding them to the store's count bounds the guesses at the
limit per process and window, at no store cost on the ordinary path.
"""

from __future__ import annotations

from collections import OrderedDict, deque

MAX_ADDRESSES = 10_000
"""Addresses remembered at once; the oldest is forgotten first (memory stays bounded)."""


class UnrecordedFailures:
    def __init__(self, max_addresses: int = MAX_ADDRESSES) -> None:
        self._by_key: OrderedDict[str, deque[float]] = OrderedDict()
        self._max = max_addresses

    def add(self, key: str, now: float) -> None:
        times = self._by_key.pop(key, None) or deque()
        times.append(now)
        self._by_key[key] = times
        while len(self._by_key) > self._max:
            self._by_key.popitem(last=False)

    def count(self, key: str, now: float, window: float) -> int:
        times = self._by_key.get(key)
        if times is None:
            return 0
        while times and times[0] <= now - window:
            times.popleft()
        if not times:
            del self._by_key[key]
            return 0
        return len(times)
