"""Watching one zone's mail per receiving provider (DESIGN.md §21): sends and provider events
counted per receiver (metrics, and the store's counters that `smtpguard stats` reads), and
the `alert` rates judged per window.

Alerts are judged per instance, from the sends and events this instance saw, as the cap
alerts are (§16); the fleet-wide rate is the Prometheus rule's (docs/prometheus-rules.yml),
which divides the fleet's counters.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from smtpguard.metrics import Metrics
from smtpguard.policy.receivers import ALERT_KINDS, EVENT_TYPES, AlertCounts, AlertRule, Shaping, stat_name

log = logging.getLogger("smtpguard.receivers")


class ReceiverWatch:
    def __init__(
        self,
        metrics: Metrics,
        bump: Callable[[str, str], None],
        shaping: Callable[[], Mapping[str, Mapping[str, Shaping]]],
        clock: Callable[[], float],
        on_alert: Callable[[str, str, str, Shaping], Awaitable[None]] | None = None,
    ) -> None:
        self._metrics = metrics
        self._bump = bump
        """Adds one to a zone's store counter (the server's StatsBuffer)."""
        self._shaping = shaping
        self._clock = clock
        self._on_alert = on_alert
        self.alerts = AlertCounts()

    def sent(self, zone: str, receivers_of: Iterable[str]) -> list[tuple[str, str]]:
        """Recipients relayed (one receiver name each); returns the (receiver, alert kind)
        pairs newly crossed."""
        tally: dict[str, int] = {}
        for r in receivers_of:
            tally[r] = tally.get(r, 0) + 1
        crossed = []
        for receiver, n in tally.items():
            self._metrics.receiver_sent(zone, receiver, n)
            for _ in range(n):
                self._bump(zone, stat_name(receiver, "sent"))
            rule = self._rule(zone, receiver)
            if rule is not None:
                fresh = self.alerts.sent(zone, receiver, rule, self._clock(), n)
                crossed += self._raise(zone, receiver, rule, fresh)
        return crossed

    def event(self, zone: str, receiver: str, kind: str) -> list[tuple[str, str]]:
        """A provider event about a recipient of `receiver`; returns the pairs crossed."""
        if kind not in EVENT_TYPES:
            return []
        self._metrics.receiver_event(zone, receiver, kind)
        self._bump(zone, stat_name(receiver, kind))
        rule = self._rule(zone, receiver)
        if rule is None:
            return []
        fresh = self.alerts.event(zone, receiver, rule, kind, self._clock())
        return self._raise(zone, receiver, rule, fresh)

    def _rule(self, zone: str, receiver: str) -> AlertRule | None:
        own = self._shaping().get(zone, {}).get(receiver)
        return own.alert if own is not None else None

    def _raise(self, zone: str, receiver: str, rule: AlertRule, fresh: list[str]) -> list[tuple[str, str]]:
        active = self.alerts.active(zone, receiver, rule, self._clock())
        for kind in rule.rates:
            self._metrics.receiver_alert.labels(zone, receiver, kind).set(1 if kind in active else 0)
        for kind in fresh:
            log.warning(
                "receiver %s of zone %s crossed its %s",
                receiver,
                zone,
                kind,
                extra={
                    "zone": zone,
                    "receiver": receiver,
                    "kind": kind,
                    "threshold": rule.rates[kind],
                    "rate": round(self.alerts.rate(zone, receiver, kind), 6),
                    "window": rule.window,
                    "counts": ALERT_KINDS[kind],
                },
            )
        return [(receiver, kind) for kind in fresh]
