"""What a running server does on the side: counters flushed, gauges refreshed, records
counted and purged, each decision counted and logged, and probe and circuit results
published to the store for `smtpguard stats`."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from smtpguard.background import keep
from smtpguard.policy.decisions import stat_name
from smtpguard.policy.limits import caps_for, month_of
from smtpguard.store import ReportsReplication, Store, StoreUnavailable

if TYPE_CHECKING:
    from smtpguard.policy.breaker import Circuit
    from smtpguard.server import Server
    from smtpguard.submission import Principal, Result

# The lifecycle's logger: these lines were always the server's, and stay so in the logs.
log = logging.getLogger("smtpguard.server")
decisions = logging.getLogger("smtpguard.decision")

STATS_FLUSH_INTERVAL = 1.0
PURGE_INTERVAL = 3600.0
GAUGE_INTERVAL = 5.0
PUBLISH_PROBE_RETRIES = (1.0, 5.0, 30.0)
"""Seconds between tries of a probe result's write to the store while it is unavailable."""
RECORD_COUNT_INTERVAL = 60.0


class StatsBuffer:
    """Per-zone counters, added up in memory and flushed to the store once a second, so a
    duplicate storm costs no store write per message."""

    def __init__(self) -> None:
        self._pending: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))

    def bump(self, zone: str, name: str) -> None:
        self._pending[zone][name] += 1

    async def flush(self, store: Store) -> None:
        pending, self._pending = self._pending, defaultdict(lambda: defaultdict(int))
        for zone, counts in pending.items():
            try:
                await store.add_counts(zone, dict(counts))
            except StoreUnavailable:
                for name, n in counts.items():
                    self._pending[zone][name] += n


class Housekeeping:
    def __init__(self, server: Server) -> None:
        self._server = server
        """Read anew each time, never a copy of what it holds: a reload swaps the config and
        the route under it."""
        self.background: set[asyncio.Task[None]] = set()
        """Circuit writes and probers being stopped: waited for (bounded) at stop."""
        self.publishing: set[asyncio.Task[None]] = set()
        """Probe results on their way to the store (retried while it is unavailable)."""
        self._probe_generation: dict[str, int] = {}

    def start(self) -> list[asyncio.Task[None]]:
        """The periodic jobs; purge and the record count run once per host (worker 0)."""
        tasks = [asyncio.create_task(self._flush_stats()), asyncio.create_task(self._refresh_gauges())]
        if self._server.singleton:
            tasks.append(asyncio.create_task(self._count_records()))
            tasks.append(asyncio.create_task(self._purge()))
        return tasks

    async def drain(self) -> None:
        """At stop: a write under way finishes; one waiting to retry is given up."""
        if self.publishing:
            await asyncio.wait(self.publishing, timeout=2)
            for publishing in self.publishing:
                publishing.cancel()
        if self.background:
            await asyncio.wait(self.background, timeout=2)

    def on_result(self, principal: Principal | None, result: Result, latency: float) -> None:
        server = self._server
        zone = principal.zone if principal else "-"
        server.stats.bump(zone, stat_name(result.decision))
        server.metrics.submission(zone, result.decision, latency)
        if principal is not None and server.cap_alerts is not None:
            # Whether a unit was consumed is the store's to say: read its counters again soon.
            server.cap_alerts.consumed(zone)
        if result.decision == "store_unavailable":
            server.metrics.event("store_error:submission")
        if decisions.isEnabledFor(logging.INFO):
            decisions.info(
                "decision",
                extra={
                    "instance": server.instance,
                    "zone": zone,
                    "user": principal.username if principal else None,
                    "client_ip": principal.client_ip if principal else None,
                    "session": principal.session if principal else None,
                    "event_key": result.key,
                    "sg_id": result.sg_id,
                    "message_id": result.message_id,
                    "decision": result.decision,
                    "reply_code": result.reply.code,
                    "enhanced": result.reply.enhanced,
                    "provider": result.provider,
                    "upstream_id": result.upstream_id,
                    "latency_ms": round(latency * 1000, 2),
                },
            )

    def probe_changed(self, provider: str, ready: bool, detail: str) -> None:
        server = self._server
        if server.route is not None:
            server.route.ready[provider] = ready
        server.metrics.probed(provider, ready)
        if server.store is not None:
            keep(self.publishing, self._publish_probe(provider, ready, detail))

    async def _publish_probe(self, provider: str, ready: bool, detail: str) -> None:
        """To the store, for `stats`; retried while the store is unavailable, until a newer
        result for the provider supersedes this one."""
        server = self._server
        assert server.store is not None
        generation = self._probe_generation[provider] = self._probe_generation.get(provider, 0) + 1
        for wait in (0.0, *PUBLISH_PROBE_RETRIES):
            if wait:
                await asyncio.sleep(wait)
                if self._probe_generation.get(provider) != generation:
                    return  # a newer result is being published
            try:
                await server.store.set_probe(server.instance, provider, ready, detail, server.clock())
                return
            except StoreUnavailable:
                pass
        log.warning("could not publish probe result", extra={"provider": provider})

    def circuit_changed(self, provider: str, circuit: Circuit) -> None:
        """Metrics at once; the store too, so `smtpguard stats` shows every instance's view."""
        self._server.metrics.circuit(provider, circuit)
        if self._server.store is not None:
            keep(self.background, self._publish_circuit(provider, circuit))

    async def _publish_circuit(self, provider: str, circuit: Circuit) -> None:
        server = self._server
        assert server.store is not None
        try:
            await server.store.set_circuit(server.instance, provider, circuit.value, server.clock())
        except StoreUnavailable:
            log.warning("could not publish circuit state", extra={"provider": provider})

    async def _refresh_gauges(self) -> None:
        """Cap headroom per zone and queue depth, every few seconds."""
        server = self._server
        assert server.store is not None
        while True:
            if server.handler is not None:
                server.metrics.connections.set(server.handler.connections.total)
            if server.gate is not None:
                # Keeps smtpguard_provider_throttled true to the store while no mail flows.
                await server.gate.refresh()
            if not server.singleton:
                # The store's view (queue depth, cap headroom) is the same from every
                # worker: worker 0 exports it.
                await asyncio.sleep(GAUGE_INTERVAL)
                continue
            try:
                depth = await server.store.queue_depths()
            except StoreUnavailable:
                server.metrics.event("store_error:gauges")
            else:
                server.metrics.queue_depths(depth)
            if isinstance(server.store, ReportsReplication):
                server.metrics.store_synchronous(server.store.synchronous)
            now = server.clock()
            if server.cap_alerts is not None:
                server.cap_alerts.prune()
            for zname, zone in server.config.zones.items():
                caps = caps_for(zone.plan, zone.hourly_cap, zone.monthly_cap)
                try:
                    usage = await server.store.cap_usage(zname, now, month_of(now))
                except StoreUnavailable:
                    break
                server.metrics.cap_remaining.labels(zname, "hour").set(max(caps.hourly - usage.hour, 0))
                server.metrics.cap_remaining.labels(zname, "month").set(max(caps.monthly - usage.month, 0))
                if server.cap_alerts is not None:
                    server.cap_alerts.observe(zname, usage, now)
            await asyncio.sleep(GAUGE_INTERVAL)

    async def _count_records(self) -> None:
        """smtpguard_ledger_records{zone,state}: a count over the state index, so once a
        minute rather than with the cheap gauges."""
        server = self._server
        assert server.store is not None
        while True:
            for zname in list(server.config.zones):
                try:
                    counts = await server.store.state_counts(zname)
                except StoreUnavailable:
                    break
                server.metrics.ledger_records(zname, counts)
            await asyncio.sleep(RECORD_COUNT_INTERVAL)

    async def _flush_stats(self) -> None:
        server = self._server
        assert server.store is not None
        while True:
            await asyncio.sleep(STATS_FLUSH_INTERVAL)
            await server.stats.flush(server.store)

    async def _purge(self) -> None:
        server = self._server
        assert server.store is not None
        while True:
            try:
                n = await server.store.purge(server.clock(), server.config.event_key.retention)
                if n:
                    log.info("purged expired ledger records", extra={"records": n})
            except StoreUnavailable as e:
                log.warning("purge skipped: store unavailable", extra={"error": str(e)})
            await asyncio.sleep(PURGE_INTERVAL)
