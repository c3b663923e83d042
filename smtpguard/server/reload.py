"""The reload diff: what a new config file changes in a running server. Everything here
reads the new file (and the secrets, keys and certificate it names) or compares two configs;
nothing live changes until the server swaps the result in (Server._swap)."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from smtpguard.config import Config, ConfigError, SmtpProviderConfig, load, outbox_secrets, provider_secrets
from smtpguard.config.secrets import logs_of
from smtpguard.policy.verdicts import login_of_another_domain
from smtpguard.relay import Route, SmtpProvider
from smtpguard.server.tls import tls_context

if TYPE_CHECKING:
    from smtpguard.console.app import Console
    from smtpguard.events.sources import Sources

log = logging.getLogger("smtpguard.server")


@dataclass(frozen=True)
class Reading:
    """One SIGHUP's reads of the files, made before anything live changes."""

    config: Config
    secrets: dict[str, str | None]
    rebuild: bool
    """The providers or the event tags they write changed: the route is built anew."""
    sources: Sources | None
    tls: ssl.SSLContext | None
    """A fresh context of the certificate files, when the listeners serve TLS."""
    outbox_passwords: dict[str, str | None]
    """Each outbox source's password as its variable or file holds it now."""
    logs: dict[str, str]
    """The log each provider's api names, its key read once for this SIGHUP (`_logs`): what
    decided `rebuild`, and what the rebuilt providers note."""


def read(path: Path, running: Config, serving_tls: bool, route: Route | None = None) -> Reading:
    """Raises ConfigError for a file that does not validate, a missing secret or a
    certificate that does not load; the running config then keeps serving. `route`: the
    running one, whose providers' data_sent notes name their logs (`noting`)."""
    new = load(path)
    noted = noting(route) if route is not None else None
    logs = _logs(new)
    rebuild = new.providers != running.providers or _event_tags(new) != _event_tags(running)
    # A key file rewritten in place may name another account's (or server's) log, while the
    # password it often shares goes to that account from now on: the notes must follow. A
    # key that cannot be read now moves nothing (the loop keeps its client of that log too).
    moved = noted is not None and any(noted.get(n) != named for n, named in logs.items())
    rebuild = rebuild or moved
    # Read on every SIGHUP: a password_file rewritten in place is a rotation.
    secrets = provider_secrets(new)
    # Re-read on every SIGHUP: a key file rewritten in place is a rotation too.
    sources = _event_sources(new)
    # One read of the files into a fresh context; the live one is never touched, so a
    # pair caught mid-renewal (new cert, old key) is refused and the old one serves.
    fresh_tls = tls_context(new) if serving_tls else None
    return Reading(new, secrets, rebuild, sources, fresh_tls, outbox_secrets(new), logs)


def noting(route: Route) -> dict[str, str]:
    """Provider name → the log its data_sent note names now (SmtpProvider.log)."""
    return {p.name: p.log for p in route.providers if p.log is not None}


def restart_warnings(old: Config, reading: Reading) -> list[str]:
    """What the new file changes that only a restart applies (listeners and the store are
    bound at start)."""
    new = reading.config
    out = []
    if new.listen != old.listen or new.store != old.store:
        out.append("listen and store changes take effect only after a restart")
    if reading.tls is None and new.tls != old.tls:
        out.append("adding or removing the tls section takes effect only after a restart")
    out += [f"{what} changes take effect only after a restart" for what in _events_restart_changes(old, new)]
    return out


def carry_over(old_route: Route, route: Route, old: Config, new: Config) -> set[str]:
    """Onto a rebuilt route, what the old one learnt of each provider that survived; returns
    the providers whose config did not change."""
    # Keep what each surviving provider's circuit has learnt.
    for name, breaker in old_route.breakers.items():
        if name in route.breakers:
            route.breakers[name] = breaker
    # A provider's readiness survives only when its config did not change: a new
    # host, port or password has not been probed yet, so it is not known to be ready.
    # Nor does a provider whose log moved (its key file rewritten): the secret it used before
    # may be another account's, whose messages the new note's log never holds.
    moved = {p.name for p in route.providers if p.log != _log_of(old_route, p.name)}
    kept = {p.name for p in new.providers if p in old.providers and p.name in route.breakers}
    unchanged = kept - moved
    route.ready.update({n: r for n, r in old_route.ready.items() if n in unchanged})
    for p in route.providers:
        before = next((o for o in old_route.providers if o.name == p.name), None)
        if isinstance(p, SmtpProvider) and isinstance(before, SmtpProvider) and p.name in unchanged:
            p.inherit(before)
    return unchanged


def _log_of(route: Route, name: str) -> str | None:
    return next((p.log for p in route.providers if p.name == name), None)


def rotate_passwords(route: Route, secrets: dict[str, str | None]) -> list[str]:
    """Same providers: each one's password as the file holds it now; the names rotated."""
    return [
        p.name
        for p in route.providers
        if isinstance(p, SmtpProvider) and p.rotate_password(secrets.get(p.name))
    ]


async def reload_console(console: Console | None, new: Config, singleton: bool) -> Console | None:
    """Operators, hashes, roles, session_ttl, hosts and trusted_proxies apply now (a
    session whose operator's hash or role changed ends); the listener's own settings
    need a restart. A console section removed stops the console: nobody stays logged
    in to a console the file no longer has. Returns the console still running."""
    if console is None:
        if new.console is not None and singleton:
            log.warning("a console added takes effect only after a restart")
        return None
    if new.console is None:
        await console.stop()
        log.warning("console stopped: the config has no console section")
        return None
    for what in console.reload(new.console):
        log.warning(f"{what} changes take effect only after a restart")
    return console


def _zone_routes(config: Config) -> dict[str, list[str]]:
    """Each zone's own route (`zones.Z.providers`, DESIGN.md §16), by zone."""
    return {z: zone.providers for z, zone in config.zones.items() if zone.providers is not None}


def _event_tags(config: Config) -> dict[str, str]:
    """Provider name → the kind of the first event source reading its webhooks, else of its
    log `api` (DESIGN.md §19: the log is searched by the tag, so it must be written)."""
    tags: dict[str, str] = {}
    if config.events is not None:
        for source in config.events.sources.values():
            tags.setdefault(source.provider, source.kind)
    for p in config.providers:
        api = getattr(p, "api", None)  # a Maildir provider has none
        if api is not None:
            tags.setdefault(p.name, api.kind)
    return tags


def _logs(config: Config) -> dict[str, str]:
    """Provider name → the log its `api` names (config.secrets.logs_of), noted with each
    attempt's data_sent. None for a Mailgun provider whose SMTP login is another domain's:
    Mailgun's SMTP credentials are a domain's (postmaster@DOMAIN), so its messages go to that
    domain's log, which the api's never holds, and absence there would send them again."""
    logs = logs_of(config)
    for i, p in enumerate(config.providers):
        if (
            p.name in logs
            and isinstance(p, SmtpProviderConfig)
            and p.api is not None
            and p.api.kind == "mailgun"
            and login_of_another_domain(p.username, p.api.domain)
        ):
            del logs[p.name]
            log.warning(
                "verdicts: no absence is proved for this provider: its SMTP login is of "
                "another Mailgun domain than its api",
                extra={"provider": p.name, "where": f"providers[{i}]", "api_domain": p.api.domain},
            )
    return logs


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
