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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from smtpguard.config import Config, ConfigError, load, provider_secrets, read_secret
from smtpguard.delivery import DeliveryWorker
from smtpguard.listener import GuardSMTP, Handler
from smtpguard.metrics import HealthServer, Metrics
from smtpguard.passwords import Verifier
from smtpguard.policy.breaker import Circuit
from smtpguard.policy.limits import caps_for, month_of
from smtpguard.relay import Route, build_providers
from smtpguard.store import Store, StoreUnavailable, store_from_url
from smtpguard.submission import Principal, Result, Submitter

if TYPE_CHECKING:
    from smtpguard.events.apply import Applier
    from smtpguard.events.mailbox import MailboxServer
    from smtpguard.events.sources import Sources
    from smtpguard.events.web import EventsServer

log = logging.getLogger("smtpguard.server")
decisions = logging.getLogger("smtpguard.decision")

STATS_FLUSH_INTERVAL = 1.0
PURGE_INTERVAL = 3600.0
GAUGE_INTERVAL = 5.0


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
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(config.tls.cert), str(config.tls.key))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError([f"tls: cannot load certificate/key: {e}"]) from None
    return ctx


class Server:
    def __init__(
        self,
        config: Config,
        config_path: Path | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self._clock = clock
        """Injected by tests; otherwise the store's clock (DESIGN.md §11.5)."""
        self.hostname = config.hostname or socket.getfqdn()
        self.instance = config.instance or f"{socket.gethostname()}:{os.getpid()}"
        self.stats = StatsBuffer()
        self._servers: list[asyncio.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self.store: Store | None = None
        self.route: Route | None = None
        self.handler: Handler | None = None
        self.ports: list[int] = []
        self.metrics = Metrics()
        self.health: HealthServer | None = None
        self.submitter: Submitter | None = None
        self.worker: DeliveryWorker | None = None
        self.events: EventsServer | None = None
        self.mailbox: MailboxServer | None = None
        self.event_applier: Applier | None = None
        self._background: set[asyncio.Future[None]] = set()
        self.unfit: list[str] = []
        """Why the store turned out unfit after start (checked once it answered)."""
        self.unfit_event = asyncio.Event()

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
        config = self.config
        secrets = provider_secrets(config)
        sources = _event_sources(config)
        ssl_ctx = tls_context(config)
        password = read_secret(config.store.password_env, config.store.password_file, "store")
        wait = config.store.wait
        self.store = store_from_url(
            config.store.url, password=password, wait=(wait.replicas, wait.timeout) if wait else None
        )
        await self.store.open()
        try:
            problems = await self.store.durability_problems()
        except StoreUnavailable:
            # Down at start: serve anyway (every submission gets 451 4.3.0 until it is back)
            # and check as soon as it answers.
            self._tasks.append(asyncio.create_task(self._check_durability_later()))
        else:
            await self._judge_durability(problems, at_start=True)
        self.route = self._route(config, secrets)
        submitter = Submitter(config, self.store, self.route, self.instance, self.hostname, self.clock)
        self.submitter = submitter
        self._ensure_worker()
        self.handler = Handler(submitter, self.store, Verifier(), self._on_result, self.clock)
        for zname, zone in config.zones.items():
            if zone.paused:
                log.info("zone paused by config", extra={"zone": zname})
        loop = asyncio.get_running_loop()
        for lst in config.listen:
            factory = self._factory(lst.tls, ssl_ctx)
            srv = await loop.create_server(
                factory,
                host=lst.host,
                port=lst.port,
                ssl=ssl_ctx if lst.tls == "implicit" else None,
                reuse_address=True,
            )
            self._servers.append(srv)
            for sock in srv.sockets:
                self.ports.append(sock.getsockname()[1])
            log.info("listening", extra={"address": lst.address, "tls": lst.tls, "port": self.ports[-1]})
        if config.metrics is not None:
            host, _, port = config.metrics.address.rpartition(":")
            self.health = HealthServer(self.metrics, self.readiness)
            await self.health.start(host.strip("[]"), int(port))
            log.info("metrics listening", extra={"address": config.metrics.address, "port": self.health.port})
        if sources is not None:
            await self._start_events(config, sources)
        self._tasks.append(asyncio.create_task(self._flush_stats()))
        self._tasks.append(asyncio.create_task(self._refresh_gauges()))
        self._tasks.append(asyncio.create_task(self._purge()))
        log.info(
            "smtpguard started",
            extra={
                "instance": self.instance,
                "store": config.store.url.split("@")[-1],
                "event_loop": type(loop).__module__.split(".")[0],
            },
        )

    async def _start_events(self, config: Config, sources: Sources) -> None:
        """The provider-event listener (§13)."""
        from smtpguard.events.apply import Applier
        from smtpguard.events.web import EventsServer

        assert config.events is not None and self.store is not None and self.submitter is not None
        self.event_applier = Applier(
            self.store, lambda: self.config.zones, self.clock, self.submitter.suppressions.invalidate
        )
        if config.events.address is not None:
            host, _, port = config.events.address.rpartition(":")
            self.events = EventsServer(
                sources, self.event_applier, config.events.max_body, self.clock, self.metrics.provider_event
            )
            await self.events.start(host.strip("[]"), int(port))
            log.info("events listening", extra={"address": config.events.address, "port": self.events.port})
        if config.events.mailbox is not None:
            from smtpguard.events.mailbox import MailboxServer

            self.mailbox = MailboxServer(
                config.events.mailbox, self.event_applier, self.hostname, self.metrics.provider_event
            )
            await self.mailbox.start()
            log.info(
                "events mailbox listening",
                extra={"address": config.events.mailbox.listen, "port": self.mailbox.port},
            )

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
        return Route(
            build_providers(config.providers, secrets, self.hostname, _event_tags(config)),
            config.breaker.failure_threshold,
            config.breaker.cooldown,
            self.clock,
            observe=self.metrics.upstream,
            on_circuit=self._circuit_changed,
        )

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
        if self.store is None or not await self.store.ping():
            return False, "store unreachable"
        if self.route is None or not self.route.any_closed():
            return False, "every provider circuit is open"
        return True, "ready"

    async def _refresh_gauges(self) -> None:
        """Cap headroom per zone for smtpguard_cap_remaining, every few seconds."""
        assert self.store is not None
        while True:
            if self.handler is not None:
                self.metrics.connections.set(self.handler.connections.total)
            now = self.clock()
            for zname, zone in self.config.zones.items():
                caps = caps_for(zone.plan, zone.hourly_cap, zone.monthly_cap)
                try:
                    usage = await self.store.cap_usage(zname, now, month_of(now))
                except StoreUnavailable:
                    break
                self.metrics.cap_remaining.labels(zname, "hour").set(max(caps.hourly - usage.hour, 0))
                self.metrics.cap_remaining.labels(zname, "month").set(max(caps.monthly - usage.month, 0))
            await asyncio.sleep(GAUGE_INTERVAL)

    def _on_result(self, principal: Principal | None, result: Result, latency: float) -> None:
        zone = principal.zone if principal else "-"
        self.stats.bump(zone, stat_name(result.decision))
        self.metrics.submission(zone, result.decision, latency)
        if decisions.isEnabledFor(logging.INFO):
            decisions.info(
                "decision",
                extra={
                    "instance": self.instance,
                    "zone": zone,
                    "user": principal.username if principal else None,
                    "event_key": result.key,
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

    async def stop(self) -> None:
        """Stop accepting, let in-flight submissions finish (bounded), close the store."""
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
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        if self.health is not None:
            await self.health.stop()
        if self.events is not None:
            await self.events.stop()
        if self.mailbox is not None:
            await self.mailbox.stop()
        if self.store is not None:
            await self.stats.flush(self.store)
        if self.route is not None:
            await self.route.close()
        if self.store is not None:
            await self.store.close()
        self._stopped.set()
        log.info("smtpguard stopped")

    async def reload(self) -> None:
        """SIGHUP: swap zones, users, caps, limits and providers without dropping connections.

        A file that does not validate, or a provider whose secret is missing, is refused and
        the running config kept. Listeners and the store are bound at start: changing them
        needs a restart, and the log says so.
        """
        if self.config_path is None or self.handler is None or self.route is None:
            return
        try:
            new = load(self.config_path)
            rebuild = new.providers != self.config.providers or _event_tags(new) != _event_tags(self.config)
            secrets = provider_secrets(new) if rebuild else None
            sources = _event_sources(new) if new.events != self.config.events else None
        except ConfigError as e:
            log.error("reload refused; keeping the running config", extra={"problems": e.problems})
            return
        if new.listen != self.config.listen or new.store != self.config.store or new.tls != self.config.tls:
            log.warning("listen, tls and store changes take effect only after a restart")
        if secrets is not None:
            old_route = self.route
            self.route = self._route(new, secrets)
            # Keep what each surviving provider's circuit has learnt.
            for name, breaker in old_route.breakers.items():
                if name in self.route.breakers:
                    self.route.breakers[name] = breaker
            self.handler.submitter.route = self.route
            # In-flight sends keep their provider objects; only idle connections are closed.
            await old_route.close()
        if sources is not None and self.events is not None:
            # Rotated signing keys apply to the next request; the address is bound at start.
            self.events.sources = sources
        if _events_address(new) != _events_address(self.config):
            log.warning("events.address changes take effect only after a restart")
        self.handler.submitter.config = new
        self.config = new
        self._ensure_worker()
        log.info("config reloaded", extra={"zones": len(new.zones), "providers": len(new.providers)})


def _event_tags(config: Config) -> dict[str, str]:
    """Provider name → the kind of the first event source reading its webhooks."""
    tags: dict[str, str] = {}
    if config.events is not None:
        for source in config.events.sources.values():
            tags.setdefault(source.provider, source.kind)
    return tags


def _events_address(config: Config) -> str | None:
    return config.events.address if config.events is not None else None


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


def serve(config: Config, config_path: Path | None) -> None:
    """Run until SIGTERM or SIGINT, on the configured event loop."""
    new_loop = loop_factory(config.event_loop)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(run(config, config_path))


async def run(config: Config, config_path: Path | None) -> None:
    server = Server(config, config_path)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(server.reload()))
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(server.unfit_event.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    log.info("stopping: no new connections, draining in-flight submissions")
    await server.stop()
    if server.unfit:
        raise ConfigError(server.unfit)
