"""Lifecycle of one smtpguard instance: start, serve, reload, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from smtpguard import notify
from smtpguard.cap_alerts import CapAlerts
from smtpguard.config import Config, ConfigError, TLSFiles, load, provider_secrets, read_secret
from smtpguard.delivery import DeliveryWorker
from smtpguard.listener import GuardSMTP, Handler
from smtpguard.metrics import HealthServer, Metrics
from smtpguard.passwords import Verifier
from smtpguard.policy.breaker import Circuit
from smtpguard.policy.limits import caps_for, month_of
from smtpguard.policy.throttle import ProviderLimits
from smtpguard.provider_gate import ConnectionSlots, ProviderGate
from smtpguard.readiness.dns import DnsClient
from smtpguard.readiness.prober import Prober
from smtpguard.recipient_domains import RecipientDomains
from smtpguard.relay import Route, SmtpProvider, build_providers
from smtpguard.store import ReportsReplication, Store, StoreUnavailable, StoreUnfit, store_from_url
from smtpguard.submission import Principal, Result, Submitter
from smtpguard.verdict_config import not_yet_applied
from smtpguard.verp import VerpKey, verp_key

if TYPE_CHECKING:
    from smtpguard.console.app import Console
    from smtpguard.events.apply import Applier
    from smtpguard.events.mailbox import MailboxServer
    from smtpguard.events.sources import Sources
    from smtpguard.events.web import EventsServer
    from smtpguard.heartbeat import Answerer
    from smtpguard.workers import WorkerRole

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


def stat_name(decision: str) -> str:
    if decision == "relayed":
        return "sent"
    return decision


def tls_context(config: Config) -> ssl.SSLContext | None:
    if config.tls is None:
        return None
    return certificate_context(config.tls)


def certificate_context(files: TLSFiles) -> ssl.SSLContext:
    """A fresh server context holding exactly this certificate and key (one read of each)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_certificate(ctx, files)
    return ctx


def load_certificate(ctx: ssl.SSLContext, files: TLSFiles) -> None:
    try:
        ctx.load_cert_chain(str(files.cert), str(files.key))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError([f"tls: cannot load certificate {files.cert} / key {files.key}: {e}"]) from None


def certificate_not_after(path: Path) -> float | None:
    """The certificate's notAfter as a Unix time, for the expiry gauge; None if unreadable.
    (The standard library decodes a PEM file only through this test hook; without it the
    gauge is just absent.)"""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        not_after = decode(str(path)).get("notAfter")
        return float(ssl.cert_time_to_seconds(not_after)) if not_after else None
    except (OSError, ValueError, ssl.SSLError):
        return None


class Server:
    def __init__(
        self,
        config: Config,
        config_path: Path | None = None,
        clock: Callable[[], float] | None = None,
        role: WorkerRole | None = None,
    ) -> None:
        self.config = config
        self.role = role
        """One of `workers: N` (smtpguard/workers.py); None: the only process."""
        self.config_path = config_path
        self._clock = clock
        """Injected by tests; otherwise the store's clock (DESIGN.md §11.5)."""
        self.hostname = config.hostname or socket.getfqdn()
        self.instance = (
            (role.instance(config.instance) if role else None)
            or config.instance
            or f"{socket.gethostname()}:{os.getpid()}"
        )
        self.stats = StatsBuffer()
        self._servers: list[asyncio.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self.store: Store | None = None
        self.route: Route | None = None
        self.gate: ProviderGate | None = None
        """Provider throttling (DESIGN.md §16): kept across reloads, so a throttle learnt
        stays in force when the route is rebuilt."""
        self.handler: Handler | None = None
        self.ports: list[int] = []
        self.metrics = Metrics(multiprocess=role.metrics_dir if role else None)
        self.health: HealthServer | None = None
        self.submitter: Submitter | None = None
        self.worker: DeliveryWorker | None = None
        self.events: EventsServer | None = None
        self.mailbox: MailboxServer | None = None
        self.verp: VerpKey | None = None
        self.console: Console | None = None
        self.event_applier: Applier | None = None
        self._background: set[asyncio.Future[None]] = set()
        self._publishing: set[asyncio.Future[None]] = set()
        """Probe results on their way to the store (retried while it is unavailable)."""
        self._probe_generation: dict[str, int] = {}
        self.unfit: list[str] = []
        """Why the store turned out unfit after start (checked once it answered)."""
        self.unfit_event = asyncio.Event()
        self.prober: Prober | None = None
        self.cap_alerts: CapAlerts | None = None
        self.ssl_ctx: ssl.SSLContext | None = None
        """The listeners' TLS context, never changed after start: its SNI callback moves each
        new handshake (STARTTLS and implicit) onto `tls_current`."""
        self.tls_current: ssl.SSLContext | None = None
        """The context of the certificate served now; a reload replaces it with a fresh one
        built from one read of the renewed files, so a bad pair leaves it untouched."""
        self.draining = False
        self.orphaned = asyncio.Event()
        """Set when this worker's supervisor is gone: the worker drains and exits."""
        self.heartbeat: Answerer | None = None
        """A worker's answers to its supervisor's heartbeat, until the very end of stop()."""

    @property
    def singleton(self) -> bool:
        """Runs what must run once per host: the only process, or worker 0."""
        return self.role is None or self.role.singleton

    def clock(self) -> float:
        """Leases, windows and history are measured on one clock for every instance sharing
        the store: the store's own (Redis TIME; SQLite is one machine's clock), so skew
        between instances can neither expire a live lease nor keep a dead one."""
        if self._clock is not None:
            return self._clock()
        if self.store is not None:
            return self.store.now()
        return time.time()

    async def start(self) -> None:
        if self.role is not None:
            # First: a worker stuck anywhere in its start is then replaced (heartbeat.py).
            self.heartbeat = self.role.answer_heartbeats(self._supervisor_gone)
        config = self.config
        secrets = provider_secrets(config)
        self.verp = verp_key(config)
        sources = _event_sources(config)
        ssl_ctx = self.ssl_ctx = self.tls_current = tls_context(config)
        if ssl_ctx is not None:
            ssl_ctx.sni_callback = self._select_certificate
        self._cert_gauge(config)
        password = read_secret(config.store.password_env, config.store.password_file, "store")
        wait = config.store.wait
        self.store = store_from_url(
            config.store.url,
            password=password,
            wait=(wait.replicas, wait.timeout) if wait else None,
            pool_size=config.store.pool_size,
        )
        try:
            await self.store.open()
        except StoreUnfit as e:
            raise ConfigError([f"store: {e}"]) from None
        try:
            problems = await self.store.durability_problems()
        except StoreUnavailable:
            # Down at start: serve anyway (every submission gets 451 4.3.0 until it is back)
            # and check as soon as it answers.
            self._tasks.append(asyncio.create_task(self._check_durability_later()))
        else:
            await self._judge_durability(problems, at_start=True)
        self.route = self._route(config, secrets)
        if self.singleton:
            # One warning per window per host, not per worker: worker 0 reads the store's
            # counters (the fleet's) after its own sends and in the gauge loop for all.
            self.cap_alerts = CapAlerts(lambda: self.config, self.store, self.metrics, self.clock)
        submitter = Submitter(config, self.store, self.route, self.instance, self.hostname, self.clock)
        submitter.verp = self.verp
        self.submitter = submitter
        self._ensure_worker()
        self.handler = Handler(
            submitter,
            self.store,
            Verifier(),
            self._on_result,
            self.clock,
            recipient_domains=self._recipient_domains(config),
            observe=self.metrics.event,
        )
        if self.role is not None:
            self.handler.connections = self.role.connections()
        for zname, zone in config.zones.items():
            if zone.paused:
                log.info("zone paused by config", extra={"zone": zname})
        loop = asyncio.get_running_loop()
        for i, lst in enumerate(config.listen):
            factory = self._factory(lst.tls, ssl_ctx)
            ssl_arg = ssl_ctx if lst.tls == "implicit" else None
            if self.role is not None:
                srv = await loop.create_server(factory, sock=self.role.listen_socket(i), ssl=ssl_arg)
            else:
                srv = await loop.create_server(
                    factory, host=lst.host, port=lst.port, ssl=ssl_arg, reuse_address=True
                )
            self._servers.append(srv)
            for sock in srv.sockets:
                self.ports.append(sock.getsockname()[1])
            log.info("listening", extra={"address": lst.address, "tls": lst.tls, "port": self.ports[-1]})
        if config.metrics is not None:
            host, _, port = config.metrics.address.rpartition(":")
            self.health = HealthServer(self.metrics, self.readiness)
            shared = self.role.metrics_socket() if self.role is not None else None
            await self.health.start(host.strip("[]"), int(port), sock=shared)
            log.info("metrics listening", extra={"address": config.metrics.address, "port": self.health.port})
        # One webhook listener, console, purge and record count per host, not one per worker.
        if sources is not None and self.singleton:
            await self._start_events(config, sources)
        if config.console is not None and self.singleton:
            await self._start_console(config)
        self._tasks.append(asyncio.create_task(self._flush_stats()))
        self._tasks.append(asyncio.create_task(self._refresh_gauges()))
        if self.singleton:
            self._tasks.append(asyncio.create_task(self._count_records()))
            self._tasks.append(asyncio.create_task(self._purge()))
        if self.role is not None:
            self._tasks.append(asyncio.create_task(self._watch_supervisor()))
        self._start_prober(config, secrets)
        log.info(
            "smtpguard started",
            extra={
                "instance": self.instance,
                "store": config.store.url.split("@")[-1],
                "event_loop": type(loop).__module__.split(".")[0],
            },
        )
        configured = not_yet_applied(config)
        if configured is not None and self.singleton:
            log.warning(
                "verdicts are configured but not yet applied: unknown outcomes still wait for an operator",
                extra=configured,
            )

    async def _start_events(self, config: Config, sources: Sources) -> None:
        """The provider-event listener (§13)."""
        from smtpguard.admission import ListenerLimits
        from smtpguard.events.apply import Applier
        from smtpguard.events.web import EventsServer

        assert config.events is not None and self.store is not None and self.submitter is not None
        self.event_applier = Applier(
            self.store, lambda: self.config.zones, self.clock, self.submitter.suppressions.invalidate
        )
        if config.events.address is not None:
            host, _, port = config.events.address.rpartition(":")
            self.events = EventsServer(
                sources,
                self.event_applier,
                config.events.max_body,
                self.clock,
                self.metrics.provider_event,
                ListenerLimits.of(config.events),
                lambda: self.config.limits,
            )
            await self.events.start(host.strip("[]"), int(port))
            log.info("events listening", extra={"address": config.events.address, "port": self.events.port})
        if config.events.mailbox is not None:
            from smtpguard.events.mailbox import MailboxServer

            mailbox = config.events.mailbox
            self.mailbox = MailboxServer(
                mailbox, self.event_applier, self.hostname, self.metrics.provider_event, self.verp
            )
            await self.mailbox.start()
            log.info(
                "events mailbox listening",
                extra={"address": config.events.mailbox.listen, "port": self.mailbox.port},
            )

    async def _start_console(self, config: Config) -> None:
        """The operator's console (§14), on the same store and config as the proxy."""
        try:
            from smtpguard.console.app import Console
        except ImportError as e:
            raise ConfigError(
                [f"console: needs the `console` extra (pip install 'smtpguard[console]'): {e}"]
            ) from None
        assert config.console is not None and self.store is not None
        self.console = Console(lambda: self.config, self.store, config.console)
        await self.console.start()
        log.info("console listening", extra={"address": config.console.address, "port": self.console.port})

    async def _judge_durability(self, problems: list[str], at_start: bool) -> None:
        """DESIGN.md §15: a store that may forget an acknowledged reservation turns a restart
        or an eviction into a duplicate; refuse it unless the operator said `unsafe`."""
        if not problems:
            return
        if self.config.store.unsafe:
            for p in problems:
                log.warning("store may forget acknowledged writes (store.unsafe)", extra={"problem": p})
            return
        refused = [f"store: {p}; fix it or set store.unsafe: true (see docs/stores.md)" for p in problems]
        if at_start:
            assert self.store is not None
            await self.store.close()
            raise ConfigError(refused)
        for p in refused:
            log.critical("stopping: %s", p)
        self.unfit = refused
        self.unfit_event.set()

    async def _check_durability_later(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(1.0)
            try:
                problems = await self.store.durability_problems()
            except StoreUnavailable:
                continue
            await self._judge_durability(problems, at_start=False)
            return

    def _route(self, config: Config, secrets: dict[str, str | None]) -> Route:
        assert self.store is not None
        limits = {
            p.name: ProviderLimits(
                p.max_rate, getattr(p, "max_connections", None), getattr(p, "throttle_backoff", 60.0)
            )
            for p in config.providers
        }
        if self.gate is None:
            self.gate = ProviderGate(
                self.store,
                limits,
                self.clock,
                on_throttled=self.metrics.throttled,
                on_rate_limited=self.metrics.rate_limited,
            )
        else:
            self.gate.limits = limits
        for name in limits:
            self.metrics.provider(name)
        self.metrics.configured({p.name for p in config.providers})
        providers = build_providers(config.providers, secrets, self.hostname, _event_tags(config))
        for p in providers:
            if isinstance(p, SmtpProvider) and p.cfg.max_connections is not None:
                fleet = ConnectionSlots(self.store, p.name, p.cfg.max_connections, self.instance, self.clock)
                p.limit_connections(fleet)
        return Route(
            providers,
            config.breaker.failure_threshold,
            config.breaker.cooldown,
            self.clock,
            observe=self.metrics.upstream,
            on_circuit=self._circuit_changed,
            shares={p.name: getattr(p, "share", 0.0) for p in config.providers},
            gate=self.gate,
            zone_routes=_zone_routes(config),
        )

    @staticmethod
    def _recipient_domains(config: Config) -> RecipientDomains | None:
        """Only when a zone checks recipient domains: otherwise RCPT pays nothing for it."""
        if not any(z.recipient_domains == "check" for z in config.zones.values()):
            return None
        dns = DnsClient(config.dns)
        if dns.problem:
            log.warning("recipient_domains: every recipient is accepted unchecked: %s", dns.problem)
        return RecipientDomains(dns)

    def _start_prober(self, config: Config, secrets: dict[str, str | None]) -> None:
        """Probe every provider with a probe_interval (DESIGN.md §12); the route, the gauge
        and the store (for `stats`) learn each result."""
        if self.prober is not None:
            self.prober.stop_later(self._background)
        self.prober = Prober(config, _ProviderSecrets(self, secrets), self.hostname, self._probe_changed)
        self.prober.start()

    def _probe_changed(self, provider: str, ready: bool, detail: str) -> None:
        if self.route is not None:
            self.route.ready[provider] = ready
        self.metrics.probed(provider, ready)
        if self.store is not None:
            task = asyncio.ensure_future(self._publish_probe(provider, ready, detail))
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)

    async def _publish_probe(self, provider: str, ready: bool, detail: str) -> None:
        """To the store, for `stats`; retried while the store is unavailable, until a newer
        result for the provider supersedes this one."""
        assert self.store is not None
        generation = self._probe_generation[provider] = self._probe_generation.get(provider, 0) + 1
        for wait in (0.0, *PUBLISH_PROBE_RETRIES):
            if wait:
                await asyncio.sleep(wait)
                if self._probe_generation.get(provider) != generation:
                    return  # a newer result is being published
            try:
                await self.store.set_probe(self.instance, provider, ready, detail, self.clock())
                return
            except StoreUnavailable:
                pass
        log.warning("could not publish probe result", extra={"provider": provider})

    def _factory(self, tls: str, ssl_ctx: ssl.SSLContext | None) -> Callable[[], GuardSMTP]:
        handler = self.handler
        assert handler is not None

        def make() -> GuardSMTP:
            # Read per connection, so a reload's limits apply to the next connection.
            limits = self.config.limits
            with warnings.catch_warnings():
                # AUTH without STARTTLS is allowed only where the channel is already safe:
                # loopback listeners (checked by config) and implicit TLS.
                warnings.simplefilter("ignore")
                return GuardSMTP(
                    handler,
                    hostname=self.hostname,
                    ident="smtpguard",
                    data_size_limit=limits.max_message_size,
                    tls_context=ssl_ctx if tls == "starttls" else None,
                    require_starttls=False,
                    auth_required=True,
                    auth_require_tls=tls == "starttls",
                    timeout=limits.idle_timeout,
                    decode_data=False,
                    enable_SMTPUTF8=True,
                )

        return make

    def _circuit_changed(self, provider: str, circuit: Circuit) -> None:
        """Metrics at once; the store too, so `smtpguard stats` shows every instance's view."""
        self.metrics.circuit(provider, circuit)
        if self.store is not None:
            task = asyncio.ensure_future(self._publish_circuit(provider, circuit))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _publish_circuit(self, provider: str, circuit: Circuit) -> None:
        assert self.store is not None
        try:
            await self.store.set_circuit(self.instance, provider, circuit.value, self.clock())
        except StoreUnavailable:
            log.warning("could not publish circuit state", extra={"provider": provider})

    def _ensure_worker(self) -> None:
        """Start the store-and-forward worker, whatever the zones' current mode: entries
        accepted before a reload or restart moved their zone back to relay were answered
        250 and must still be delivered (DESIGN.md §11.2). Idle, it costs one claim query
        per poll_interval."""
        if self.worker is not None or self.submitter is None or self.store is None:
            return
        self.worker = DeliveryWorker(
            self.submitter,
            self.store,
            lambda zone, result: self._on_result(Principal(zone, "delivery"), result, 0.0),
        )
        self.submitter.on_enqueue = self.worker.wake
        self.worker.start()
        log.info("store-and-forward worker started", extra={"workers": self.config.queue.workers})

    async def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining: stopping, no new connections"
        if self.store is None or not await self.store.ping():
            return False, "store unreachable"
        if self.route is None or not self.route.any_closed():
            return False, "every provider circuit is open"
        return True, "ready"

    async def _refresh_gauges(self) -> None:
        """Cap headroom per zone and queue depth, every few seconds."""
        assert self.store is not None
        while True:
            if self.handler is not None:
                self.metrics.connections.set(self.handler.connections.total)
            if self.gate is not None:
                # Keeps smtpguard_provider_throttled true to the store while no mail flows.
                await self.gate.refresh()
            if not self.singleton:
                # The store's view (queue depth, cap headroom) is the same from every
                # worker: worker 0 exports it.
                await asyncio.sleep(GAUGE_INTERVAL)
                continue
            try:
                depth = await self.store.queue_depths()
            except StoreUnavailable:
                self.metrics.event("store_error:gauges")
            else:
                self.metrics.queue_depths(depth)
            if isinstance(self.store, ReportsReplication):
                self.metrics.store_synchronous(self.store.synchronous)
            now = self.clock()
            if self.cap_alerts is not None:
                self.cap_alerts.prune()
            for zname, zone in self.config.zones.items():
                caps = caps_for(zone.plan, zone.hourly_cap, zone.monthly_cap)
                try:
                    usage = await self.store.cap_usage(zname, now, month_of(now))
                except StoreUnavailable:
                    break
                self.metrics.cap_remaining.labels(zname, "hour").set(max(caps.hourly - usage.hour, 0))
                self.metrics.cap_remaining.labels(zname, "month").set(max(caps.monthly - usage.month, 0))
                if self.cap_alerts is not None:
                    self.cap_alerts.observe(zname, usage, now)
            await asyncio.sleep(GAUGE_INTERVAL)

    async def _count_records(self) -> None:
        """smtpguard_ledger_records{zone,state}: a count over the state index, so once a
        minute rather than with the cheap gauges."""
        assert self.store is not None
        while True:
            for zname in list(self.config.zones):
                try:
                    counts = await self.store.state_counts(zname)
                except StoreUnavailable:
                    break
                self.metrics.ledger_records(zname, counts)
            await asyncio.sleep(RECORD_COUNT_INTERVAL)

    def _on_result(self, principal: Principal | None, result: Result, latency: float) -> None:
        zone = principal.zone if principal else "-"
        self.stats.bump(zone, stat_name(result.decision))
        self.metrics.submission(zone, result.decision, latency)
        if principal is not None and self.cap_alerts is not None:
            # Whether a unit was consumed is the store's to say: read its counters again soon.
            self.cap_alerts.consumed(zone)
        if result.decision == "store_unavailable":
            self.metrics.event("store_error:submission")
        if decisions.isEnabledFor(logging.INFO):
            decisions.info(
                "decision",
                extra={
                    "instance": self.instance,
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

    async def _flush_stats(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(STATS_FLUSH_INTERVAL)
            await self.stats.flush(self.store)

    async def _watch_supervisor(self) -> None:
        assert self.role is not None
        # Nothing announces a parent's death to a child that did not ask the kernel
        # (PR_SET_PDEATHSIG is Linux-only): look once a second.
        while not self.role.orphaned():  # noqa: ASYNC110
            await asyncio.sleep(1.0)
        self._supervisor_gone()

    def _supervisor_gone(self) -> None:
        if not self.orphaned.is_set():
            log.error("the supervisor is gone; stopping this worker")
        self.orphaned.set()

    async def _purge(self) -> None:
        assert self.store is not None
        while True:
            try:
                n = await self.store.purge(self.clock(), self.config.event_key.retention)
                if n:
                    log.info("purged expired ledger records", extra={"records": n})
            except StoreUnavailable as e:
                log.warning("purge skipped: store unavailable", extra={"error": str(e)})
            await asyncio.sleep(PURGE_INTERVAL)

    def _select_certificate(
        self, conn: ssl.SSLObject | ssl.SSLSocket, _name: str | None, ctx: ssl.SSLContext
    ) -> None:
        """Called by OpenSSL for every ClientHello, with or without SNI."""
        current = self.tls_current
        if current is not None and current is not ctx:
            conn.context = current

    def _cert_gauge(self, config: Config) -> None:
        not_after = certificate_not_after(config.tls.cert) if config.tls is not None else None
        if not_after is not None:
            self.metrics.cert_expiry.set(not_after)

    async def stop(self) -> None:
        """Stop accepting, let in-flight submissions finish (bounded), close the store.
        /readyz answers 503 from the first moment, so a load balancer stops sending here."""
        self.draining = True
        self.metrics.draining.set(1)
        if self.handler is not None:
            self.handler.draining = True
        for srv in self._servers:
            srv.close()
        if self.handler is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.handler.idle.wait(), self.config.limits.drain_timeout)
        if self.worker is not None:
            await self.worker.stop(self.config.limits.drain_timeout)
        if self.submitter is not None:
            await self.submitter.leases.close()
        if self.handler is not None and self.handler.active:
            log.warning(
                "drain timeout; in-flight submissions abandoned (their leases expire)",
                extra={"active": self.handler.active},
            )
        if self.prober is not None:
            await self.prober.stop()
        if self.cap_alerts is not None:
            await self.cap_alerts.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._publishing:
            # A write under way finishes; one waiting to retry is given up.
            await asyncio.wait(self._publishing, timeout=2)
            for publishing in self._publishing:
                publishing.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        if self.health is not None:
            await self.health.stop()
        if self.events is not None:
            await self.events.stop()
        if self.mailbox is not None:
            await self.mailbox.stop()
        if self.console is not None:
            await self.console.stop()
        if self.store is not None:
            await self.stats.flush(self.store)
        if self.route is not None:
            await self.route.close()
            # One turn of the loop: the upstream transports just closed get their
            # connection_lost before a caller ends the loop (else each is left "closing").
            await asyncio.sleep(0)
        if self.store is not None:
            await self.store.close()
        if self.heartbeat is not None:
            self.heartbeat.close()
        self._stopped.set()
        log.info("smtpguard stopped")

    async def reload(self) -> bool:
        """SIGHUP: swap zones, users, caps, limits and providers without dropping connections,
        and re-read the TLS certificate and key (a renewal needs no restart).

        A file that does not validate, a provider whose secret is missing, or a certificate
        that does not load is refused and the running config kept. Listeners and the store
        are bound at start: changing them needs a restart, and the log says so.
        """
        if self.config_path is None or self.handler is None or self.route is None:
            return False
        try:
            return await self._reload()
        except Exception as e:
            # Whatever went wrong, the running config (and certificate) keeps serving.
            self.metrics.reloads.labels("refused").inc()
            log.error(
                "reload refused; keeping the running config", extra={"error": f"{type(e).__name__}: {e}"}
            )
            return False

    async def _reload(self) -> bool:
        assert self.config_path is not None and self.handler is not None and self.route is not None
        try:
            new = load(self.config_path)
            rebuild = new.providers != self.config.providers or _event_tags(new) != _event_tags(self.config)
            # Read on every SIGHUP: a password_file rewritten in place is a rotation.
            fresh_secrets = provider_secrets(new)
            secrets = fresh_secrets if rebuild else None
            # Re-read on every SIGHUP: a key file rewritten in place is a rotation too.
            sources = _event_sources(new)
            # One read of the files into a fresh context; the live one is never touched, so a
            # pair caught mid-renewal (new cert, old key) is refused and the old one serves.
            fresh_tls = tls_context(new) if self.ssl_ctx is not None else None
        except ConfigError as e:
            self.metrics.reloads.labels("refused").inc()
            log.error("reload refused; keeping the running config", extra={"problems": e.problems})
            return False
        if new.listen != self.config.listen or new.store != self.config.store:
            log.warning("listen and store changes take effect only after a restart")
        if fresh_tls is not None:
            self.tls_current = fresh_tls
            self._cert_gauge(new)
        elif new.tls != self.config.tls:
            log.warning("adding or removing the tls section takes effect only after a restart")
        if secrets is not None:
            old_route = self.route
            self.route = self._route(new, secrets)
            # Keep what each surviving provider's circuit has learnt.
            for name, breaker in old_route.breakers.items():
                if name in self.route.breakers:
                    self.route.breakers[name] = breaker
            # A provider's readiness survives only when its config did not change: a new
            # host, port or password has not been probed yet, so it is not known to be ready.
            unchanged = {
                p.name for p in new.providers if p in self.config.providers and p.name in self.route.breakers
            }
            self.route.ready.update({n: r for n, r in old_route.ready.items() if n in unchanged})
            for p in self.route.providers:
                before = next((o for o in old_route.providers if o.name == p.name), None)
                if isinstance(p, SmtpProvider) and isinstance(before, SmtpProvider) and p.name in unchanged:
                    p.inherit(before)
            for name in {p.name for p in self.config.providers} - unchanged:
                # Gone or changed: no stale 1 in smtpguard_provider_ready until it is probed.
                self.metrics.forget_probe(name)
            self.handler.submitter.route = self.route
            # In-flight sends keep their provider objects; only idle connections are closed.
            await old_route.close()
        else:
            # Same providers: the pools and circuits stay, the zones' own routes may not.
            self.route.set_zone_routes(_zone_routes(new))
            rotated = [
                p.name
                for p in self.route.providers
                if isinstance(p, SmtpProvider) and p.rotate_password(fresh_secrets.get(p.name))
            ]
            if rotated:
                log.info("provider password re-read", extra={"providers": rotated})
                # The prober authenticates too: with the old secret it would call a good
                # provider not ready.
                self._start_prober(new, fresh_secrets)
        if self.events is not None:
            # Rotated signing keys apply to the next request; a source removed answers 404.
            from smtpguard.events.sources import Sources

            self.events.sources = sources if sources is not None else Sources()
        for what in _events_restart_changes(self.config, new):
            log.warning(f"{what} changes take effect only after a restart")
        self.handler.submitter.config = new
        if new.dns != self.config.dns or self.handler.recipient_domains is None:
            self.handler.recipient_domains = self._recipient_domains(new)
        if secrets is not None:
            self._start_prober(new, secrets)
        self.config = new
        await self._reload_console(new)
        self._ensure_worker()
        self.metrics.reloads.labels("applied").inc()
        log.info("config reloaded", extra={"zones": len(new.zones), "providers": len(new.providers)})
        return True

    async def _reload_console(self, new: Config) -> None:
        """Operators, hashes, roles, session_ttl, hosts and trusted_proxies apply now (a
        session whose operator's hash or role changed ends); the listener's own settings
        need a restart. A console section removed stops the console: nobody stays logged
        in to a console the file no longer has."""
        if self.console is None:
            if new.console is not None and self.singleton:
                log.warning("a console added takes effect only after a restart")
            return
        if new.console is None:
            await self.console.stop()
            self.console = None
            log.warning("console stopped: the config has no console section")
            return
        for what in self.console.reload(new.console):
            log.warning(f"{what} changes take effect only after a restart")


class _ProviderSecrets(Mapping[str, str | None]):
    """What the prober authenticates with: each provider's secret as the relay holds it
    now, so a password_file re-read after a 535 reaches the probes too (a prober left on
    the refused secret would call a provider that sends fine not ready)."""

    def __init__(self, server: Server, at_start: dict[str, str | None]) -> None:
        self._server = server
        self._at_start = at_start

    def __getitem__(self, name: str) -> str | None:
        route = self._server.route
        for p in route.providers if route is not None else ():
            if p.name == name and isinstance(p, SmtpProvider):
                return p.password
        return self._at_start[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._at_start)

    def __len__(self) -> int:
        return len(self._at_start)


def _zone_routes(config: Config) -> dict[str, list[str]]:
    """Each zone's own route (`zones.Z.providers`, DESIGN.md §16), by zone."""
    return {z: zone.providers for z, zone in config.zones.items() if zone.providers is not None}


def _event_tags(config: Config) -> dict[str, str]:
    """Provider name → the kind of the first event source reading its webhooks."""
    tags: dict[str, str] = {}
    if config.events is not None:
        for source in config.events.sources.values():
            tags.setdefault(source.provider, source.kind)
    return tags


_LISTENER_LIMITS = ("max_connections", "max_connections_per_ip", "read_timeout", "idle_timeout")


def _events_restart_changes(old: Config, new: Config) -> list[str]:
    """The events settings bound at start that a reload cannot change."""
    before, after = old.events, new.events
    changed = []
    for name in ("address", "max_body", "mailbox", *_LISTENER_LIMITS):
        if getattr(before, name, None) != getattr(after, name, None):
            changed.append(f"events.{name}")
    return changed


def _event_sources(config: Config) -> Sources | None:
    """The configured event sources with their secrets, read at start (or reload) so that a
    missing one is a config error, not a 500 at the first webhook."""
    if config.events is None:
        return None
    try:
        from smtpguard.events.sources import build_sources
        from smtpguard.events.web import EventsServer  # noqa: F401 - fail now when aiohttp is missing
    except ImportError as e:
        raise ConfigError(
            [f"events: needs the `events` extra (pip install 'smtpguard[events]'): {e}"]
        ) from None
    return build_sources(config.events)


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop the server runs on. uvloop (libuv, sockets and timers in C) takes
    about a fifth off smtpguard's CPU time per message; see bench/README.md."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError(
                    [
                        "event_loop: uvloop, but the uvloop package is not installed "
                        "(pip install 'smtpguard[fast]')"
                    ]
                ) from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def serve(config: Config, config_path: Path | None, role: WorkerRole | None = None) -> None:
    """Run until SIGTERM or SIGINT, on the configured event loop."""
    new_loop = loop_factory(config.event_loop)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(run(config, config_path, role))


async def run(config: Config, config_path: Path | None, role: WorkerRole | None = None) -> None:
    server = Server(config, config_path, role=role)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        notify.reloading()
        try:
            await server.reload()
        finally:
            notify.ready(f"serving {len(server.config.zones)} zone(s)")

    def on_hup() -> None:
        task = asyncio.create_task(reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    if role is None:
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    else:
        # The supervisor checks the file and sends SIGUSR1; a SIGHUP sent to the whole
        # process group must not make every worker reload (or refuse) on its own too.
        loop.add_signal_handler(signal.SIGHUP, lambda: None)
        loop.add_signal_handler(signal.SIGUSR1, on_hup)
        role.mark_ready()
    # systemd (Type=notify) starts the units ordered after this one only now: listeners,
    # store and metrics are up.
    notify.ready(f"serving {len(config.zones)} zone(s)")
    waiters = [
        asyncio.create_task(stop.wait()),
        asyncio.create_task(server.unfit_event.wait()),
        asyncio.create_task(server.orphaned.wait()),
    ]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    if role is not None:
        # A worker hears SIGTERM twice (from the process group, then from its supervisor):
        # the second must not kill the drain, nor the exit after it.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
    notify.stopping()
    log.info("stopping: no new connections, draining in-flight submissions")
    await server.stop()
    if server.unfit:
        raise ConfigError(server.unfit)
