"""Building the listeners beside SMTP from the config: the provider-event webhooks and
mailbox (§13) and the operator's console (§14); and the jobs once per host that read the
providers' logs (§19: the verdict loop, reconciliation). Each needs an optional extra, imported only
when configured; the server starts and stops them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from smtpguard.config import (
    Config,
    ConfigError,
    ConsoleConfig,
    EventsConfig,
    MailboxConfig,
    SmtpProviderConfig,
)
from smtpguard.metrics import Metrics
from smtpguard.store import Store
from smtpguard.submission import Submitter
from smtpguard.verp import VerpKey

log = logging.getLogger("smtpguard.server")

if TYPE_CHECKING:
    from smtpguard.console.app import Console
    from smtpguard.events.apply import Applier
    from smtpguard.events.mailbox import MailboxServer
    from smtpguard.events.reconcile import Reconciler
    from smtpguard.events.sources import Sources
    from smtpguard.events.web import EventsServer
    from smtpguard.verdicts.loop import VerdictLoop
    from smtpguard.verdicts.model import LogApi


def applier(
    store: Store,
    submitter: Submitter,
    config: Callable[[], Config],
    clock: Callable[[], float],
    on_event: Callable[[str, str, str], None] = lambda zone, recipient, kind: None,
) -> Applier:
    from smtpguard.events.apply import Applier

    return Applier(store, lambda: config().zones, clock, submitter.suppressions.invalidate, on_event)


def events_server(
    events: EventsConfig,
    sources: Sources,
    applier: Applier,
    metrics: Metrics,
    clock: Callable[[], float],
    config: Callable[[], Config],
) -> EventsServer:
    from smtpguard.events.web import EventsServer

    return EventsServer(
        sources,
        applier,
        events.max_body,
        clock,
        metrics.provider_event,
        events,
        lambda: config().limits,
        metrics.verdict,
    )


def mailbox_server(
    mailbox: MailboxConfig,
    applier: Applier,
    hostname: str,
    metrics: Metrics,
    verp: VerpKey | None,
    max_recipients: Callable[[], int],
) -> MailboxServer:
    from smtpguard.events.mailbox import MailboxServer, ReportHandler

    handler = ReportHandler(mailbox, applier, metrics.provider_event, verp, max_recipients)
    return MailboxServer(handler, hostname)


def console(config: Callable[[], Config], store: Store, console: ConsoleConfig) -> Console:
    try:
        from smtpguard.console.app import Console
    except ImportError as e:
        raise ConfigError(
            [f"console: needs the `console` extra (pip install 'smtpguard[console]'): {e}"]
        ) from None
    return Console(config, store, console)


def reconciler(
    config: Config, store: Store, applier: Applier, metrics: Metrics, clock: Callable[[], float]
) -> Reconciler | None:
    """§19 reconciliation: one client per provider with an `api`, each key read now (a
    missing one fails at start). None without a `reconcile:` section."""
    if config.reconcile is None:
        return None
    from smtpguard.events.reconcile import Reconciler, source_names
    from smtpguard.verdicts import clients_for

    # Clients of their own (the verdict loop has its own pool per API): each closes its own.
    apis = clients_for(config, wall=clock)
    kinds = {p.name: p.api.kind for p in config.providers if isinstance(p, SmtpProviderConfig) and p.api}
    sources = {} if config.events is None else config.events.sources
    names = source_names(kinds, {name: (s.kind, s.provider) for name, s in sources.items()})
    return Reconciler(store, applier, apis, names, config.reconcile.events, clock, metrics.provider_event)


def verdict_loop(
    config: Callable[[], Config],
    store: Store,
    clients: Mapping[str, LogApi],
    metrics: Metrics,
    clock: Callable[[], float],
) -> VerdictLoop:
    """§19's verdict loop over `clients` (verdicts.clients_for); aiohttp, the events extra,
    is imported only when a provider has an `api`."""
    from smtpguard.verdicts.loop import VerdictLoop

    return VerdictLoop(config, store, clients, clock, metrics.verdict, metrics.verdict_api_error)


def reloaded_verdict_clients(config: Config, clock: Callable[[], float]) -> dict[str, LogApi]:
    """The log clients of a reloaded config, for a loop that was not running; none when a
    key cannot be read (logged: the reload itself stands, as the running loop's would)."""
    from smtpguard.verdicts import clients_for

    try:
        return clients_for(config, wall=clock)
    except ConfigError as e:
        log.warning("verdicts: a reloaded api cannot be used", extra={"error": "; ".join(e.problems)})
        return {}
