"""Building, from one config, the parts a submission passes through: the provider route
(behind a ProviderGate kept across reloads), the Submitter, the Handler, its recipient
domain check and each listener's protocol factory. Start builds them once; a reload builds
a new route and recipient check from the new file and the server swaps them in."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from smtpguard.config import Config, LimitsConfig, ListenerConfig
from smtpguard.listener import GuardSMTP, Handler
from smtpguard.metrics import Metrics
from smtpguard.passwords import Verifier
from smtpguard.policy.breaker import Circuit
from smtpguard.policy.throttle import ProviderLimits
from smtpguard.provider_gate import ConnectionSlots, ProviderGate
from smtpguard.readiness.dns import DnsClient
from smtpguard.receivers import Receivers, enabled
from smtpguard.recipient_domains import RecipientDomains
from smtpguard.relay import Route, SmtpProvider, build_providers
from smtpguard.server.reload import _event_tags, _logs, _zone_routes
from smtpguard.store import Store
from smtpguard.submission import Principal, Result, Submitter
from smtpguard.verp import VerpKey

log = logging.getLogger("smtpguard.server")


@dataclass(eq=False, repr=False)
class Assembly:
    metrics: Metrics
    clock: Callable[[], float]
    instance: str
    hostname: str
    on_circuit: Callable[[str, Circuit], None]
    gate: ProviderGate | None = field(init=False, default=None)
    """Provider throttling (DESIGN.md §16): kept across reloads, so a throttle learnt
    stays in force when the route is rebuilt."""
    receivers: Receivers | None = field(init=False, default=None)
    """Receiving providers (DESIGN.md §21): kept across reloads (the MX cache and the
    alert windows stay) unless the resolver changed."""

    def route(
        self, store: Store, config: Config, secrets: dict[str, str | None], logs: dict[str, str] | None = None
    ) -> Route:
        """`logs`: the providers' logs as a reload already read them (else read now)."""
        limits = {
            p.name: ProviderLimits(
                p.max_rate, getattr(p, "max_connections", None), getattr(p, "throttle_backoff", 60.0)
            )
            for p in config.providers
        }
        if self.gate is None:
            self.gate = ProviderGate(
                store,
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
        logs = _logs(config) if logs is None else logs
        providers = build_providers(config.providers, secrets, self.hostname, _event_tags(config), logs)
        for p in providers:
            if isinstance(p, SmtpProvider) and p.cfg.max_connections is not None:
                fleet = ConnectionSlots(store, p.name, p.cfg.max_connections, self.instance, self.clock)
                p.limit_connections(fleet)
        return Route(
            providers,
            config.breaker.failure_threshold,
            config.breaker.cooldown,
            self.clock,
            observe=self.metrics.upstream,
            on_circuit=self.on_circuit,
            shares={p.name: getattr(p, "share", 0.0) for p in config.providers},
            gate=self.gate,
            zone_routes=_zone_routes(config),
        )

    def submitter(self, config: Config, store: Store, route: Route, verp: VerpKey | None) -> Submitter:
        return Submitter(config, store, route, self.instance, self.hostname, self.clock, verp=verp)

    def handler(
        self,
        config: Config,
        submitter: Submitter,
        store: Store,
        on_result: Callable[[Principal | None, Result, float], None],
    ) -> Handler:
        return Handler(
            submitter,
            store,
            Verifier(),
            on_result,
            self.clock,
            recipient_domains=recipient_domains(config),
            observe=self.metrics.event,
        )

    def receivers_for(
        self,
        config: Config,
        store: Store,
        submitter: Submitter,
        bump: Callable[[str, str], None],
        judge_alerts: bool,
    ) -> Receivers | None:
        """The receivers of `config` (None when it watches none), for start and each reload."""
        if self.receivers is not None and not (
            enabled(config) and self.receivers.lookup.dns.config == config.dns
        ):
            self.receivers.stop_judging()  # replaced below, or off: its counts are all in
        if not enabled(config):
            self.receivers = None
        elif self.receivers is not None and self.receivers.lookup.dns.config == config.dns:
            self.receivers.configure(config)
        else:
            dns = DnsClient(config.dns)
            if dns.problem:
                log.warning("receivers: every recipient counts as other: %s", dns.problem)
            pauses = submitter.class_pauses
            self.receivers = Receivers(
                config, dns, store, pauses, self.metrics, bump, self.clock, judge_alerts
            )
        return self.receivers

    async def listen(
        self,
        handler: Handler,
        config: Config,
        ssl_ctx: ssl.SSLContext | None,
        limits: Callable[[], LimitsConfig],
        sockets: Callable[[int], socket.socket] | None,
    ) -> list[tuple[ListenerConfig, asyncio.Server]]:
        """One SMTP server per `listen` entry: on the supervisor's shared socket under
        `workers: N` (`sockets(i)`), else bound here."""
        loop = asyncio.get_running_loop()
        servers = []
        for i, lst in enumerate(config.listen):
            factory = self.factory(handler, lst.tls, ssl_ctx, limits)
            ssl_arg = ssl_ctx if lst.tls == "implicit" else None
            if sockets is not None:
                srv = await loop.create_server(factory, sock=sockets(i), ssl=ssl_arg)
            else:
                srv = await loop.create_server(
                    factory, host=lst.host, port=lst.port, ssl=ssl_arg, reuse_address=True
                )
            servers.append((lst, srv))
        return servers

    def factory(
        self,
        handler: Handler,
        tls: str,
        ssl_ctx: ssl.SSLContext | None,
        limits: Callable[[], LimitsConfig],
    ) -> Callable[[], GuardSMTP]:
        hostname = self.hostname

        def make() -> GuardSMTP:
            # Read per connection, so a reload's limits apply to the next connection.
            now = limits()
            with warnings.catch_warnings():
                # AUTH without STARTTLS is allowed only where the channel is already safe:
                # loopback listeners (checked by config) and implicit TLS.
                warnings.simplefilter("ignore")
                return GuardSMTP(
                    handler,
                    hostname=hostname,
                    ident="smtpguard",
                    data_size_limit=now.max_message_size,
                    tls_context=ssl_ctx if tls == "starttls" else None,
                    require_starttls=False,
                    auth_required=True,
                    auth_require_tls=tls == "starttls",
                    timeout=now.idle_timeout,
                    decode_data=False,
                    enable_SMTPUTF8=True,
                )

        return make


def recipient_domains(config: Config) -> RecipientDomains | None:
    """Only when a zone checks recipient domains: otherwise RCPT pays nothing for it."""
    if not any(z.recipient_domains == "check" for z in config.zones.values()):
        return None
    dns = DnsClient(config.dns)
    if dns.problem:
        log.warning("recipient_domains: every recipient is accepted unchecked: %s", dns.problem)
    return RecipientDomains(dns)


class ProviderSecrets(Mapping[str, str | None]):
    """What the prober authenticates with: each provider's secret as the relay holds it
    now, so a password_file re-read after a 535 reaches the probes too (a prober left on
    the refused secret would call a provider that sends fine not ready)."""

    def __init__(self, route: Callable[[], Route | None], at_start: dict[str, str | None]) -> None:
        self._route = route
        self._at_start = at_start

    def __getitem__(self, name: str) -> str | None:
        route = self._route()
        for p in route.providers if route is not None else ():
            if p.name == name and isinstance(p, SmtpProvider):
                return p.password
        return self._at_start[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._at_start)

    def __len__(self) -> int:
        return len(self._at_start)
