"""Counting one zone's mail per receiving provider (DESIGN.md §21): sends and provider events,
in this instance's metrics and in the store's counters (added up here and flushed once a
second, as every stat is), which `smtpguard stats`, the console and the alerts read."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from smtpguard.metrics import Metrics
from smtpguard.policy.receivers import EVENT_TYPES, stat_name


class ReceiverWatch:
    def __init__(self, metrics: Metrics, bump: Callable[[str, str], None]) -> None:
        self._metrics = metrics
        self._bump = bump
        """Adds one to a zone's store counter (the server's StatsBuffer)."""

    def sent(self, zone: str, receivers_of: Iterable[str]) -> None:
        """Recipients relayed, one receiver name each."""
        tally: dict[str, int] = {}
        for r in receivers_of:
            tally[r] = tally.get(r, 0) + 1
        for receiver, n in tally.items():
            self._metrics.receiver_sent(zone, receiver, n)
            for _ in range(n):
                self._bump(zone, stat_name(receiver, "sent"))

    def event(self, zone: str, receiver: str, kind: str) -> None:
        """A provider event about a recipient of `receiver`."""
        if kind not in EVENT_TYPES:
            return
        self._metrics.receiver_event(zone, receiver, kind)
        self._bump(zone, stat_name(receiver, kind))
