"""Lifecycle of one smtpguard instance: start, serve, reload, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from smtpguard.cap_alerts import CapAlerts
from smtpguard.config import Config, ConfigError, outbox_secrets, provider_secrets, read_secret
from smtpguard.delivery import DeliveryWorker
from smtpguard.listener import Handler
from smtpguard.metrics import HealthServer, Metrics
from smtpguard.provider_gate import ProviderGate
from smtpguard.readiness.prober import Prober
from smtpguard.recipient_domains import RecipientDomains
from smtpguard.relay import Route
from smtpguard.server import durability, side_listeners
from smtpguard.server import reload as reloading
from smtpguard.server.assembly import Assembly, ProviderSecrets, recipient_domains
from smtpguard.server.event_loop import loop_factory as loop_factory  # re-exported: tests
from smtpguard.server.housekeeping import Housekeeping, StatsBuffer
from smtpguard.server.reload import _event_sources as _event_sources  # re-exported: supervisor
from smtpguard.server.tls import gauge_expiry
from smtpguard.server.tls import tls_context as tls_context  # re-exported: cli, supervisor
from smtpguard.store import UNREACHABLE, Store, StoreUnavailable, StoreUnfit, store_from_url
from smtpguard.submission import Principal, Submitter
from smtpguard.verdicts import clients_for
from smtpguard.verp import VerpKey, verp_key

if TYPE_CHECKING:
    from smtpguard.console.app import Console
    from smtpguard.events.apply import Applier
    from smtpguard.events.mailbox import MailboxServer
    from smtpguard.events.reconcile import Reconciler
    from smtpguard.events.sources import Sources
    from smtpguard.events.web import EventsServer
    from smtpguard.heartbeat import Answerer
    from smtpguard.outbox.reader import OutboxReader
    from smtpguard.verdicts.loop import VerdictLoop
    from smtpguard.verdicts.model import LogApi
    from smtpguard.workers import WorkerRole


log = logging.getLogger("smtpguard.server")


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
        self._reloading = asyncio.Lock()
        """Held by a reload from its read to its last swap, and taken by stop before it tears
        anything down: a SIGHUP just before SIGTERM never starts an outbox reader, a prober or
        a console after the drain, and two SIGHUPs apply in the order they were read."""
        self.store: Store | None = None
        self.route: Route | None = None
        self.handler: Handler | None = None
        self.ports: list[int] = []
        self.metrics = Metrics(multiprocess=role.metrics_dir if role else None)
        self.health: HealthServer | None = None
        self.submitter: Submitter | None = None
        self.worker: DeliveryWorker | None = None
        self.outbox: list[OutboxReader] = []
        self.events: EventsServer | None = None
        self.mailbox: MailboxServer | None = None
        self.verp: VerpKey | None = None
        self.console: Console | None = None
        self.event_applier: Applier | None = None
        self.reconciler: Reconciler | None = None
        self.housekeeping = Housekeeping(self)
        self.assembly = Assembly(
            self.metrics, self.clock, self.instance, self.hostname, self.housekeeping.circuit_changed
        )
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
        self.verdicts: VerdictLoop | None = None
        """DESIGN.md §19, once per host (worker 0), when a provider has an `api`."""

    @property
    def gate(self) -> ProviderGate | None:
        return self.assembly.gate

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
        verdict_clients = clients_for(config, wall=self.clock) if self.singleton else {}
        ssl_ctx = self.ssl_ctx = self.tls_current = tls_context(config)
        if ssl_ctx is not None:
            ssl_ctx.sni_callback = self._select_certificate
        gauge_expiry(self.metrics, config)
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
        self.route = self.assembly.route(self.store, config, secrets)
        if self.singleton:
            # One warning per window per host, not per worker: worker 0 reads the store's
            # counters (the fleet's) after its own sends and in the gauge loop for all.
            self.cap_alerts = CapAlerts(lambda: self.config, self.store, self.metrics, self.clock)
        submitter = self.assembly.submitter(config, self.store, self.route, self.verp)
        self.submitter = submitter
        self._ensure_worker()
        self._swap_outbox(config, outbox_secrets(config))
        self.handler = self.assembly.handler(config, submitter, self.store, self.housekeeping.on_result)
        self._receivers(config)
        if self.role is not None:
            self.handler.connections = self.role.connections()
        for zname, zone in config.zones.items():
            if zone.paused:
                log.info("zone paused by config", extra={"zone": zname})
        loop = asyncio.get_running_loop()
        sockets = self.role.listen_socket if self.role is not None else None
        for lst, srv in await self.assembly.listen(
            self.handler, config, ssl_ctx, lambda: self.config.limits, sockets
        ):
            self._servers.append(srv)
            self.ports += [sock.getsockname()[1] for sock in srv.sockets]
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
        if config.reconcile is not None and self.singleton:
            self._start_reconcile(config)
        self._tasks += self.housekeeping.start()
        self._start_verdicts(verdict_clients)
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

    def _start_reconcile(self, config: Config) -> None:
        """§19: poll the providers' log APIs for the events webhooks missed; once per host,
        and once per fleet in effect (the store's cursors, events/reconcile.py)."""
        assert self.store is not None and self.submitter is not None
        from smtpguard.events import reconcile

        if self.event_applier is None:
            self.event_applier = side_listeners.applier(
                self.store, self.submitter, lambda: self.config, self.clock
            )
        self.reconciler = side_listeners.reconciler(
            config, self.store, self.event_applier, self.metrics, self.clock
        )
        if self.reconciler is not None:
            self._tasks.append(asyncio.create_task(reconcile.run(self.reconciler)))
            log.info("reconciliation started", extra={"apis": sorted(self.reconciler.apis)})

    def _receiver_event(self, zone: str, recipient: str, kind: str) -> None:
        if self.assembly.receivers is not None:
            self.assembly.receivers.event(zone, recipient, kind)

    async def _start_events(self, config: Config, sources: Sources) -> None:
        """The provider-event listener (§13)."""
        assert config.events is not None and self.store is not None and self.submitter is not None
        self.event_applier = side_listeners.applier(
            self.store, self.submitter, lambda: self.config, self.clock, self._receiver_event
        )
        if config.events.address is not None:
            host, _, port = config.events.address.rpartition(":")
            self.events = side_listeners.events_server(
                config.events, sources, self.event_applier, self.metrics, self.clock, lambda: self.config
            )
            await self.events.start(host.strip("[]"), int(port))
            log.info("events listening", extra={"address": config.events.address, "port": self.events.port})
        if config.events.mailbox is not None:
            self.mailbox = side_listeners.mailbox_server(
                config.events.mailbox,
                self.event_applier,
                self.hostname,
                self.metrics,
                self.verp,
                lambda: self.config.limits.max_recipients,
            )
            await self.mailbox.start()
            log.info(
                "events mailbox listening",
                extra={"address": config.events.mailbox.listen, "port": self.mailbox.port},
            )

    async def _start_console(self, config: Config) -> None:
        """The operator's console (§14), on the same store and config as the proxy."""
        assert config.console is not None and self.store is not None
        self.console = side_listeners.console(lambda: self.config, self.store, config.console)
        await self.console.start()
        log.info("console listening", extra={"address": config.console.address, "port": self.console.port})

    async def _judge_durability(self, problems: list[str], at_start: bool) -> None:
        refused = durability.refusals(problems, self.config.store.unsafe)
        if not refused:
            return
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
        await self._judge_durability(await durability.first_answer(self.store), at_start=False)

    def _start_prober(self, config: Config, secrets: dict[str, str | None]) -> None:
        """Probe every provider with a probe_interval (DESIGN.md §12); the route, the gauge
        and the store (for `stats`) learn each result."""
        if self.prober is not None:
            self.prober.stop_later(self.housekeeping.background)
        held_now = ProviderSecrets(lambda: self.route, secrets)
        self.prober = Prober(config, held_now, self.hostname, self.housekeeping.probe_changed)
        self.prober.start()

    def _receivers(self, config: Config) -> None:
        """Receiving providers (DESIGN.md §21) for the listener and the queue's worker."""
        assert self.handler is not None and self.store is not None
        found = self.assembly.receivers_for(
            config, self.store, self.handler.submitter, self.stats.bump, self.singleton
        )
        self.handler.receivers = found
        if self.worker is not None:
            self.worker.receivers = found

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
            lambda zone, result: self.housekeeping.on_result(Principal(zone, "delivery"), result, 0.0),
        )
        self.worker.receivers = self.assembly.receivers
        self.submitter.on_enqueue = self.worker.wake
        self.worker.start()
        log.info("store-and-forward worker started", extra={"workers": self.config.queue.workers})

    def _swap_outbox(self, config: Config, passwords: Mapping[str, str | None]) -> list[OutboxReader]:
        """The outbox readers (DESIGN.md §20), one set per host: claims let several hosts
        share one table, and one reader per worker would only add connections. Returns the
        readers a reload halted (their source removed or changed)."""
        if not self.singleton or self.submitter is None or not (config.outbox or self.outbox):
            return []
        from smtpguard.server import outboxes

        make = outboxes.maker(
            self.submitter,
            self.clock,
            lambda p, result: self.housekeeping.on_result(p, result, 0.0),
            self.metrics.outbox,
            lambda: self.handler,  # its recipient-domain check and receivers, per row
        )
        self.outbox, halted = outboxes.replace_readers(self.outbox, config.outbox, passwords, make)
        return halted

    async def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining: stopping, no new connections"
        unready = UNREACHABLE if self.store is None else await self.store.unready()
        if unready is not None:
            return False, unready
        if self.route is None or not self.route.any_closed():
            return False, "every provider circuit is open"
        return True, "ready"

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

    def _select_certificate(
        self, conn: ssl.SSLObject | ssl.SSLSocket, _name: str | None, ctx: ssl.SSLContext
    ) -> None:
        """Called by OpenSSL for every ClientHello, with or without SNI."""
        current = self.tls_current
        if current is not None and current is not ctx:
            conn.context = current

    async def stop(self) -> None:
        """Stop accepting, let in-flight submissions finish (bounded), close the store.
        /readyz answers 503 from the first moment, so a load balancer stops sending here."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        self.metrics.draining.set(1)
        if self.handler is not None:
            self.handler.draining = True
        for srv in self._servers:
            srv.close()
        # A reload under way applies first (its every await is bounded); one wedged past
        # drain_timeout is not waited for, or a SIGTERM could never stop the process.
        try:
            async with asyncio.timeout(self.config.limits.drain_timeout):
                await self._reloading.acquire()
        except TimeoutError:
            log.warning("stopping while a reload is still under way")
            await self._drain()
            return
        try:
            await self._drain()
        finally:
            self._reloading.release()

    async def _drain(self) -> None:
        if self.handler is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.handler.idle.wait(), self.config.limits.drain_timeout)
        for reader in self.outbox:
            await reader.stop(self.config.limits.drain_timeout)
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
        if self.assembly.receivers is not None:
            await self.assembly.receivers.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.housekeeping.drain()
        if self.verdicts is not None:
            await self.verdicts.close()
        for listener in (self.health, self.events, self.mailbox, self.console):
            if listener is not None:
                await listener.stop()
        if self.reconciler is not None:
            from smtpguard.events import reconcile

            await reconcile.close(self.reconciler)
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

    def _start_verdicts(self, clients: Mapping[str, LogApi]) -> None:
        """§19's loop, once per host: at start, or at the reload that gives the first provider
        an `api` (a running loop follows later changes of them itself)."""
        if not clients or self.verdicts is not None or not self.singleton:
            return
        assert self.store is not None
        self.verdicts = side_listeners.verdict_loop(
            lambda: self.config, self.store, clients, self.metrics, self.clock
        )
        self._tasks.append(asyncio.create_task(self.verdicts.run()))
        log.info("verdict loop started", extra={"apis": sorted(clients)})

    async def reload(self) -> bool:
        """SIGHUP: swap zones, users, caps, limits and providers without dropping connections,
        and re-read the TLS certificate and key (a renewal needs no restart).

        A file that does not validate, a provider whose secret is missing, or a certificate
        that does not load is refused and the running config kept. Listeners and the store
        are bound at start: changing them needs a restart, and the log says so.
        """
        if self.config_path is None or self.handler is None or self.route is None:
            return False
        # Looked at before the lock and after it: stop holds the lock for its whole drain,
        # and a reload queued behind another may find stop begun meanwhile.
        if self._stopping():
            return False
        async with self._reloading:
            if self._stopping():
                return False
            try:
                return await self._reload()
            except Exception as e:
                # Whatever went wrong, the running config (and certificate) keeps serving.
                self.metrics.reloads.labels("refused").inc()
                log.error(
                    "reload refused; keeping the running config",
                    extra={"error": f"{type(e).__name__}: {e}"},
                )
                return False

    def _stopping(self) -> bool:
        if self.draining:
            log.warning("reload refused: stopping")
        return self.draining

    async def _reload(self) -> bool:
        assert self.config_path is not None and self.handler is not None and self.route is not None
        assert self.store is not None
        try:
            reading = reloading.read(self.config_path, self.config, self.ssl_ctx is not None, self.route)
        except ConfigError as e:
            self.metrics.reloads.labels("refused").inc()
            log.error("reload refused; keeping the running config", extra={"problems": e.problems})
            return False
        old, new = self.config, reading.config
        for warning in reloading.restart_warnings(old, reading):
            log.warning(warning)
        old_route = route = self.route
        if reading.rebuild:
            route = self.assembly.route(self.store, new, reading.secrets, reading.logs)
            unchanged = reloading.carry_over(old_route, route, old, new)
            for name in {p.name for p in old.providers} - unchanged:
                # Gone or changed: no stale 1 in smtpguard_provider_ready until it is probed.
                self.metrics.forget_probe(name)
        if new.dns != old.dns or self.handler.recipient_domains is None:
            domains = recipient_domains(new)
        else:
            domains = self.handler.recipient_domains
        halted = self._swap(reading, route, domains)
        if reading.rebuild:
            # In-flight sends keep their provider objects; only idle connections are closed.
            await old_route.close()
            self._start_prober(new, reading.secrets)
        else:
            # Same providers: the pools and circuits stay; each password as its file has it now.
            rotated = reloading.rotate_passwords(route, reading.secrets)
            if rotated:
                log.info("provider password re-read", extra={"providers": rotated})
                # The prober authenticates too: with the old secret it would call a good
                # provider not ready.
                self._start_prober(new, reading.secrets)
        self.console = await reloading.reload_console(self.console, new, self.singleton)
        if self.verdicts is None and self.singleton:
            self._start_verdicts(side_listeners.reloaded_verdict_clients(new, self.clock))
        for reader in halted:
            await reader.stop(new.limits.drain_timeout)
        self._ensure_worker()
        self.metrics.reloads.labels("applied").inc()
        log.info("config reloaded", extra={"zones": len(new.zones), "providers": len(new.providers)})
        return True

    def _swap(
        self, reading: reloading.Reading, route: Route, domains: RecipientDomains | None
    ) -> list[OutboxReader]:
        """The one place a reload changes what serves. Every live reference moves to the new
        file's parts here, with no await in between, so no submission sees the new route
        with the old zones or the other way round."""
        assert self.handler is not None
        new = reading.config
        if reading.tls is not None:
            self.tls_current = reading.tls
            gauge_expiry(self.metrics, new)
        if route is self.route:
            # Same providers: the pools and circuits stay, the zones' own routes may not.
            route.set_zone_routes(reloading._zone_routes(new))
        self.route = route
        self.handler.submitter.route = route
        self.handler.submitter.config = new
        self.handler.recipient_domains = domains
        self._receivers(new)
        if self.events is not None:
            # Rotated signing keys apply to the next request; a source removed answers 404.
            from smtpguard.events.sources import Sources

            self.events.sources = reading.sources if reading.sources is not None else Sources()
        self.config = new
        return self._swap_outbox(new, reading.outbox_passwords)
