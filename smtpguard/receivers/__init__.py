"""Receiving providers (DESIGN.md §21): a recipient's mailbox provider found from its MX
hosts (lookup.py), its mail shaped per zone (gate.py), counted (watch.py) and its alert rates
judged (alerts.py). Receivers joins them for the listener, the delivery worker and the
provider-event applier.

On when the config has a top-level `receivers:` (`{}` for the built-ins alone) or any zone
has `receivers:`; otherwise RCPT makes no MX lookup for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from smtpguard import desk
from smtpguard.class_pauses import ClassPauses
from smtpguard.config import Config
from smtpguard.metrics import Metrics
from smtpguard.policy import receivers as policy
from smtpguard.policy.receivers import Shaping
from smtpguard.readiness.dns import DnsClient
from smtpguard.receivers.alerts import ALERT_INTERVAL, ReceiverAlerts
from smtpguard.receivers.gate import ReceiverGate
from smtpguard.receivers.lookup import ReceiverLookup
from smtpguard.receivers.watch import ReceiverWatch
from smtpguard.replies import Reply
from smtpguard.store import Store, StoreUnavailable

__all__ = ["Receivers", "enabled"]

log = logging.getLogger("smtpguard.receivers")

MAX_BACKGROUND = 1000
"""Counting tasks (a send's or an event's lookup) kept at once; past it, counts are dropped
rather than memory grown — a count is a statistic, not a promise."""


def enabled(config: Config) -> bool:
    return config.receivers is not None or any(z.receivers for z in config.zones.values())


def shaping_of(config: Config) -> dict[str, dict[str, Shaping]]:
    return {z: {r: s.shaping() for r, s in zc.receivers.items()} for z, zc in config.zones.items()}


class Receivers:
    def __init__(
        self,
        config: Config,
        dns: DnsClient,
        store: Store,
        pauses: ClassPauses,
        metrics: Metrics,
        bump: Callable[[str, str], None],
        clock: Callable[[], float],
        judge_alerts: bool = True,
    ) -> None:
        self._store = store
        self._clock = clock
        self.shaping: dict[str, dict[str, Shaping]] = {}
        self.lookup = ReceiverLookup(dns, config.receiver_table())
        self.gate = ReceiverGate(store, pauses, lambda: self.shaping, clock)
        self.watch = ReceiverWatch(metrics, bump)
        self.alerts = ReceiverAlerts(store, metrics, lambda: self.shaping, clock, self._act, self._slow)
        self._background: set[asyncio.Task[None]] = set()
        self._alerting: asyncio.Task[None] | None = None
        if judge_alerts:
            # One judge per host (worker 0), as for the cap alerts: one warning a window.
            self._alerting = asyncio.get_running_loop().create_task(self._judge_alerts())
        self.configure(config)

    def configure(self, config: Config) -> None:
        """A reload: the new table and settings (the cached MX hosts stay good)."""
        self.shaping = shaping_of(config)
        self.lookup.table = config.receiver_table()

    # --- the wire ----------------------------------------------------------------------------
    async def rcpt_refusal(self, zone: str, address: str, queued: bool) -> Reply | None:
        """RCPT: `451 4.7.1` for a recipient whose receiver is paused or over max_rate in
        relay mode; in queue mode the entry waits at delivery instead (hold_until), and RCPT
        waits for no lookup (it is begun, for the worker and the count)."""
        if queued:
            self.lookup.start(address)
            return None
        receiver = await self.lookup.shaped(address)
        if receiver is None:
            return None
        return await self.gate.rcpt_refusal(zone, receiver)

    async def hold_until(self, zone: str, entry: str, recipients: Sequence[str]) -> float | None:
        tally: dict[str, int] = {}
        for r in await self.lookup.shaped_all(recipients):
            if r is not None:
                tally[r] = tally.get(r, 0) + 1
        return await self.gate.hold_until(zone, entry, tally)

    # --- counting ----------------------------------------------------------------------------
    def sent(self, zone: str, recipients: Iterable[str]) -> None:
        """Recipients relayed: counted per receiver (from the cache RCPT filled, else after a
        lookup in the background: the reply never waits for a count)."""
        addresses = list(recipients)
        known = [self.lookup.cached(a) for a in addresses]
        if all(r is not None for r in known):
            self.watch.sent(zone, [r for r in known if r is not None])
            return
        self._spawn(self._sent_later(zone, addresses))

    def event(self, zone: str, recipient: str, kind: str) -> None:
        """A provider event (§13, and §19 reconciliation) about `recipient` of `zone`:
        counted per receiver. The one function event sources call."""
        if kind not in policy.EVENT_TYPES:
            return
        cached = self.lookup.cached(recipient)
        if cached is not None:
            self.watch.event(zone, cached, kind)
            return
        self._spawn(self._event_later(zone, recipient, kind))

    async def _sent_later(self, zone: str, addresses: list[str]) -> None:
        found = await self.lookup.shaped_all(addresses)
        self.watch.sent(zone, [r or policy.OTHER for r in found])

    async def _event_later(self, zone: str, recipient: str, kind: str) -> None:
        receiver = await self.lookup.receiver(recipient)
        self.watch.event(zone, receiver, kind)

    async def _judge_alerts(self) -> None:
        while True:
            await asyncio.sleep(ALERT_INTERVAL)
            try:
                await self.alerts.refresh()
            except Exception:  # a bug here must not stop the judging, nor reach mail
                log.exception("receiver alerts: refresh failed")

    async def _act(self, zone: str, receiver: str, own: Shaping) -> None:
        """`on_alert: pause`: the receiver paused for the zone in the store (every instance,
        audited) until an operator resumes it."""
        try:
            await desk.set_receiver_paused(self._store, zone, receiver, True, "alert")
        except StoreUnavailable as e:
            log.warning(
                "on_alert: pause could not be stored",
                extra={"zone": zone, "receiver": receiver, "error": str(e)},
            )

    async def _slow(self, zone: str, receiver: str, slowed: bool) -> None:
        """`on_alert: slow`: max_rate halved in every worker and instance (the store's
        control) while the window that crossed lasts. A store that fails is asked again at
        the next look (ReceiverAlerts keeps what it last stored only once it is stored)."""
        await desk.set_receiver_slowed(self._store, zone, receiver, slowed, "alert")

    def _spawn(self, work: object) -> None:
        assert asyncio.iscoroutine(work)
        if len(self._background) >= MAX_BACKGROUND:
            work.close()
            return
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stop_judging(self) -> None:
        """Replaced by a reload (another resolver): the new one judges from now on."""
        if self._alerting is not None:
            self._alerting.cancel()
            self._background.add(self._alerting)
            self._alerting.add_done_callback(self._background.discard)
            self._alerting = None

    async def close(self) -> None:
        self.stop_judging()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background))
