"""`smtpguard_cap_used_ratio{zone,window}` and the `alert_at` warnings (DESIGN.md §16).

The ratio comes from the store's cap counters (`cap_usage`), so it shows what the whole
fleet has sent, not this instance alone. It is read again shortly after this instance
consumes a unit (debounced: at most one read per zone per REFRESH_DEBOUNCE, however busy)
and every few seconds for every zone by serve's gauge loop. A submission never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from smtpguard.background import keep
from smtpguard.config import Config
from smtpguard.metrics import Metrics
from smtpguard.policy.alerts import AlertLedger, Window, used_ratio
from smtpguard.policy.limits import caps_for, month_of
from smtpguard.store import Store, StoreUnavailable
from smtpguard.store.base import CapUsage

log = logging.getLogger("smtpguard.alerts")

REFRESH_DEBOUNCE = 0.5


@dataclass(eq=False)
class CapAlerts:
    config: Callable[[], Config]
    store: Store
    metrics: Metrics
    clock: Callable[[], float]
    _ledger: AlertLedger = field(init=False, default_factory=AlertLedger)
    _pending: set[str] = field(init=False, default_factory=set)
    _last: dict[str, float] = field(init=False, default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    _shown: set[tuple[str, Window]] = field(init=False, default_factory=set)
    """The (zone, window) series the gauge has: one left behind keeps an alert firing."""

    def consumed(self, zone: str) -> None:
        """A unit of the zone's cap may have been used: read its usage again soon."""
        if zone in self._pending or zone not in self.config().zones:
            return
        self._pending.add(zone)
        keep(self._tasks, self._later(zone))

    async def _later(self, zone: str) -> None:
        try:
            wait = self._last.get(zone, 0.0) + REFRESH_DEBOUNCE - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        finally:
            # Cleared before the read: a unit consumed while it runs asks for another.
            self._pending.discard(zone)
        await self.refresh(zone)

    async def refresh(self, zone: str) -> None:
        """Read the zone's usage from the store; set the gauge, warn on a crossing."""
        cfg = self.config().zones.get(zone)
        if cfg is None:
            return
        self._last[zone] = time.monotonic()
        now = self.clock()
        try:
            usage = await self.store.cap_usage(zone, now, month_of(now))
        except StoreUnavailable:
            return
        self.observe(zone, usage, now)

    def observe(self, zone: str, usage: CapUsage, now: float) -> None:
        """The zone's usage as just read from the store (here or by serve's gauge loop)."""
        cfg = self.config().zones.get(zone)
        if cfg is None:
            return
        caps = caps_for(cfg.plan, cfg.hourly_cap, cfg.monthly_cap)
        windows: tuple[tuple[Window, int, int], ...] = (
            ("hour", usage.hour, caps.hourly),
            ("month", usage.month, caps.monthly),
        )
        for window, used, cap in windows:
            ratio = used_ratio(used, cap)
            if ratio is None:
                # A zero cap has no share: no series, rather than the last one's value.
                self._hide(zone, window)
                continue
            self.metrics.cap_used_ratio.labels(zone, window).set(ratio)
            self._shown.add((zone, window))
            for threshold in self._ledger.newly_crossed(zone, window, ratio, cfg.alert_at, now):
                log.warning(
                    "zone %s has used %d%% of its %s cap",
                    zone,
                    round(threshold * 100),
                    "hourly" if window == "hour" else "monthly",
                    extra={
                        "zone": zone,
                        "window": window,
                        "threshold": threshold,
                        "used": used,
                        "cap": cap,
                        "ratio": round(ratio, 4),
                    },
                )

    def prune(self) -> None:
        """Drop the series (and the warnings given) of zones a reload removed."""
        zones = self.config().zones
        for zone, window in [k for k in self._shown if k[0] not in zones]:
            self._hide(zone, window)
        self._ledger.forget(lambda zone: zone not in zones)

    def _hide(self, zone: str, window: Window) -> None:
        if (zone, window) in self._shown:
            self._shown.discard((zone, window))
            self.metrics.cap_used_ratio.remove(zone, window)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
