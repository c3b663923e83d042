"""A receiver's `alert` rates (DESIGN.md §21), judged from the store's counters — the whole
fleet's sends and events, whichever instance or worker counted them — as the cap alerts are
(§16), by one process per host (worker 0), every ALERT_INTERVAL: one warning per window per
host, and `smtpguard_receiver_alert{zone,receiver,kind}`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from smtpguard.metrics import Metrics
from smtpguard.policy.receivers import AlertWindows, Shaping, receiver_counts
from smtpguard.store import Store, StoreUnavailable

log = logging.getLogger("smtpguard.receivers")

ALERT_INTERVAL = 5.0
"""Seconds between two readings of the counters (which instances flush once a second)."""


@dataclass(eq=False, repr=False)
class ReceiverAlerts:
    store: Store
    metrics: Metrics
    shaping: Callable[[], Mapping[str, Mapping[str, Shaping]]]
    clock: Callable[[], float]
    on_alert: Callable[[str, str, Shaping], Awaitable[None]]
    """Carries out a crossed rule's `on_alert: pause`."""
    on_slow: Callable[[str, str, bool], Awaitable[None]]
    """Begins or ends `on_alert: slow` for every worker and instance (the store's)."""
    _slowed: dict[tuple[str, str], bool] = field(init=False, default_factory=dict)
    """What this judge last stored of each receiver's slow (absent: not yet, so its
    first look writes it, ending one a judge before a restart left behind)."""
    windows: AlertWindows = field(init=False, default_factory=AlertWindows)

    async def refresh(self) -> list[tuple[str, str, str]]:
        """Read every zone's counters that has an alert rule; warn on a crossing. Returns
        the (zone, receiver, kind) newly crossed. A store that does not answer is read next
        time: alerts are a statistic, never in mail's way."""
        crossed: list[tuple[str, str, str]] = []
        now = self.clock()
        for zone, receivers in self.shaping().items():
            rules = {r: s for r, s in receivers.items() if s.alert is not None}
            if not rules:
                continue
            try:
                counts = receiver_counts(await self.store.counts(zone))
            except StoreUnavailable:
                return crossed
            for receiver, own in rules.items():
                assert own.alert is not None
                totals = counts.get(receiver, {})
                fresh = self.windows.observe(zone, receiver, own.alert, totals, now)
                active = self.windows.active(zone, receiver, own.alert, now)
                for kind in own.alert.rates:
                    self.metrics.receiver_alert.labels(zone, receiver, kind).set(1 if kind in active else 0)
                for kind in fresh:
                    self._warn(zone, receiver, own, kind)
                    crossed.append((zone, receiver, kind))
                if fresh and own.on_alert == "pause":
                    await self.on_alert(zone, receiver, own)
                if own.on_alert == "slow" and self._slowed.get((zone, receiver)) != bool(active):
                    # Slowed while the window that crossed lasts; the next one ends it.
                    try:
                        await self.on_slow(zone, receiver, bool(active))
                    except StoreUnavailable:
                        continue  # asked again at the next look
                    self._slowed[(zone, receiver)] = bool(active)
        return crossed

    def _warn(self, zone: str, receiver: str, own: Shaping, kind: str) -> None:
        assert own.alert is not None
        log.warning(
            "receiver %s of zone %s crossed its %s",
            receiver,
            zone,
            kind,
            extra={
                "zone": zone,
                "receiver": receiver,
                "kind": kind,
                "threshold": own.alert.rates[kind],
                "rate": round(self.windows.rate(zone, receiver, kind), 6),
                "window": own.alert.window,
            },
        )
