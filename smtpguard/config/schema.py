"""The whole config (DESIGN.md §9): every section, and the checks that span sections."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from smtpguard.config.base import Duration, FieldProblem, _host_port, _Strict
from smtpguard.config.dns import DnsConfig
from smtpguard.config.event_key import EventKeyConfig
from smtpguard.config.events import ConsoleConfig, EventsConfig
from smtpguard.config.listener import LimitsConfig, ListenerConfig, TLSFiles
from smtpguard.config.outbox import SOURCE_NAME, OutboxSource
from smtpguard.config.providers import BreakerConfig, ProviderConfig, SmtpProviderConfig
from smtpguard.config.queue import QueueConfig
from smtpguard.config.receivers import Suffixes, check_receiver_names, unknown_receiver
from smtpguard.config.store import StoreConfig
from smtpguard.config.verdicts import ReconcileConfig, VerdictsConfig, api_problem
from smtpguard.config.workers import _workers
from smtpguard.config.zones import _ZONE_NAME, UserConfig, ZoneConfig
from smtpguard.policy import receivers as receiver_policy
from smtpguard.policy.throttle import CONNECTION_WAIT, RATE_WAIT


class MetricsConfig(_Strict):
    address: str = "127.0.0.1:9587"

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        _host_port(v)
        return v


class LogConfig(_Strict):
    format: Literal["json", "text"] = "json"
    level: Literal["debug", "info", "warning", "error"] = "info"


class Config(_Strict):
    listen: list[ListenerConfig] = Field(min_length=1)
    tls: TLSFiles | None = None
    store: StoreConfig = StoreConfig()
    event_key: EventKeyConfig = EventKeyConfig()
    limits: LimitsConfig = LimitsConfig()
    providers: list[ProviderConfig] = Field(min_length=1)
    dns: DnsConfig = DnsConfig()
    breaker: BreakerConfig = BreakerConfig()
    queue: QueueConfig = QueueConfig()
    metrics: MetricsConfig | None = None
    events: EventsConfig | None = None
    console: ConsoleConfig | None = None
    verdicts: VerdictsConfig | None = None
    reconcile: ReconcileConfig | None = None
    log: LogConfig = LogConfig()
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """auto: uvloop when installed (the `fast` extra), else asyncio's own loop."""
    hostname: str | None = None
    """Name in the greeting and in derived Message-IDs; default: the machine's FQDN."""
    instance: str | None = None
    """This instance's name in leases and history; default: hostname and process id."""
    workers: Annotated[int | Literal["auto"], BeforeValidator(_workers)] = 1
    """Worker processes behind one supervisor (DESIGN.md §17); auto: one per usable core."""
    workers_heartbeat: Duration = Field(30.0, ge=10.0, le=3600.0)
    """With workers: a worker whose event loop answers no heartbeat for this long is killed
    and replaced (DESIGN.md §18). At least 10s: a healthy loop is held for most of a second
    by each message near max_message_size, and messages that end together add up; a worker
    killed for that cuts every session it holds."""
    receivers: dict[str, Suffixes] | None = None
    """Receiving providers by MX host suffix (DESIGN.md §21), over the built-in gmail,
    microsoft, yahoo and apple: a name given replaces its suffixes, `[]` removes it."""
    zones: dict[str, ZoneConfig] = Field(min_length=1)
    outbox: dict[str, OutboxSource] = Field(default_factory=dict)
    """Application tables of send requests, by source name (DESIGN.md §20)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        for i, lst in enumerate(self.listen):
            if self.tls is None and lst.tls != "none":
                raise FieldProblem(
                    ("listen", i, "tls"),
                    f"tls: {lst.tls} needs the top-level `tls: {{cert, key}}` section",
                )
        first: dict[str, int] = {}
        for i, p in enumerate(self.providers):
            if p.name in first:
                raise FieldProblem(
                    ("providers", i, "name"),
                    f"provider name {p.name!r} is already used by providers[{first[p.name]}]",
                )
            first[p.name] = i
        names = [p.name for p in self.providers]
        lead = self.providers[0]
        if isinstance(lead, SmtpProviderConfig) and lead.share:
            raise FieldProblem(
                ("providers", 0, "share"),
                f"providers[0] ({lead.name}) is the primary: share is for a standby, "
                "the primary takes whatever the standbys do not",
            )
        shared = sum(p.share for p in self.providers if isinstance(p, SmtpProviderConfig))
        if shared > 0.5:
            raise FieldProblem(
                ("providers",),
                f"the standbys' shares add up to {shared:g}; more than 0.5 makes the primary a standby",
            )
        for zname in self.zones:
            if not _ZONE_NAME.match(zname) or zname == "global":
                raise FieldProblem(
                    ("zones", zname),
                    f"zone name {zname!r} must be lower-case letters, digits, . _ - and not 'global'",
                )
        seen: dict[str, str] = {}
        for zname, zcfg in self.zones.items():
            for i, user in enumerate(zcfg.users):
                if user.username in seen:
                    raise FieldProblem(
                        ("zones", zname, "users", i, "username"),
                        f"user {user.username!r} is also a user of zone {seen[user.username]}",
                    )
                seen[user.username] = zname
            for i, pname in enumerate(zcfg.providers or ()):
                if pname not in names:
                    raise FieldProblem(
                        ("zones", zname, "providers", i),
                        f"provider {pname!r} is not one of providers: {', '.join(names)}",
                    )
                if zcfg.providers and zcfg.providers.index(pname) != i:
                    raise FieldProblem(
                        ("zones", zname, "providers", i), f"provider {pname!r} is listed twice"
                    )
            if zcfg.default_class and zcfg.default_class not in self.queue.classes:
                raise FieldProblem(
                    ("zones", zname, "default_class"),
                    f"{zcfg.default_class!r} is not one of queue.classes "
                    f"({', '.join(sorted(self.queue.classes))})",
                )
        if self.events is not None:
            located: list[tuple[tuple[str | int, ...], str]] = [
                (("events", "sources", n, "provider"), src.provider) for n, src in self.events.sources.items()
            ]
            if self.events.mailbox is not None:
                located.append((("events", "mailbox", "provider"), self.events.mailbox.provider))
            for loc, provider in located:
                if provider not in names:
                    known = ", ".join(names)
                    raise FieldProblem(loc, f"provider {provider!r} is not one of providers: {known}")
        return self

    @model_validator(mode="after")
    def _receiver_checks(self) -> Config:
        check_receiver_names(self.receivers or {}, ("receivers",))
        known = set(self.receiver_table())
        for zname, zcfg in self.zones.items():
            for rname in zcfg.receivers:
                problem = unknown_receiver(rname, known)
                if problem:
                    raise FieldProblem(("zones", zname, "receivers", rname), problem)
        for cname in self.queue.classes:
            if cname.startswith(receiver_policy.CONTROL_PREFIX):
                raise FieldProblem(
                    ("queue", "classes", cname),
                    f"class name {cname!r}: names starting {receiver_policy.CONTROL_PREFIX!r} "
                    "are receivers' pauses",
                )
        return self

    def receiver_table(self) -> dict[str, tuple[str, ...]]:
        """Receiver name → MX host suffixes: the built-ins with `receivers:` over them."""
        return receiver_policy.table(self.receivers)

    def send_timeout(self) -> float:
        """The longest one relay can keep talking to providers after its last lease renewal:
        the whole route (a failover walks it), each SMTP provider's connect, its session's
        commands (EHLO to RSET) and DATA timeouts, twice for one that dedupes (an unknown
        outcome there is retried once). A Maildir write is bounded by the disk, not by a
        timeout: a minute is generous."""
        total = 0.0
        for p in self.providers:
            if p.max_rate is not None:
                total += RATE_WAIT  # waiting for its send slot (DESIGN.md §16)
            if isinstance(p, SmtpProviderConfig) and p.max_connections is not None:
                total += CONNECTION_WAIT
            if isinstance(p, SmtpProviderConfig):
                t = p.timeouts
                # EHLO, STARTTLS, EHLO, AUTH, MAIL, RCPT… and RSET: eight command round trips.
                one = t.connect + 8 * t.command + t.data
                total += 2 * one if p.idempotency_header else one
            else:
                total += 60.0
        return total

    def user_zone(self, username: str) -> tuple[str, UserConfig] | None:
        for zname, zone in self.zones.items():
            for user in zone.users:
                if user.username == username:
                    return zname, user
        return None

    @model_validator(mode="after")
    def _outbox_checks(self) -> Config:
        tables: dict[tuple[str, str], str] = {}
        for name, src in self.outbox.items():
            first = tables.setdefault((src.url, src.table), name)
            if first != name:
                # Each row would go to whichever reader claims it first, as its zone.
                raise FieldProblem(
                    ("outbox", name, "table"),
                    f"table {src.table} of {src.url} is already source {first!r}: one source per table",
                )
            if not SOURCE_NAME.fullmatch(name):
                raise FieldProblem(
                    ("outbox", name), f"outbox source name {name!r}: lower-case letters, digits, . _ -"
                )
            zone = self.zones.get(src.zone)
            if zone is None:
                raise FieldProblem(("outbox", name, "zone"), f"zone {src.zone!r} is not one of zones")
            if all(u.username != src.user for u in zone.users):
                raise FieldProblem(
                    ("outbox", name, "user"), f"user {src.user!r} is not a user of zone {src.zone}"
                )
        return self

    @model_validator(mode="after")
    def _verdict_checks(self) -> Config:
        with_api = sum(1 for p in self.providers if isinstance(p, SmtpProviderConfig) and p.api is not None)
        problem = api_problem(with_api, self.reconcile)
        if problem:
            raise FieldProblem(("reconcile",), problem)
        sources = self.events.sources.items() if self.events is not None else ()
        for i, p in enumerate(self.providers):
            if not isinstance(p, SmtpProviderConfig) or p.api is None or p.api.kind == "mailgun":
                continue
            # The relay writes the tag of the first source reading the provider's webhooks
            # (server/reload.py _event_tags). SendGrid's and Postmark's logs are searched by
            # their own tag alone: under another one every accepted message would be absent
            # from them, and `not accepted` sends it again.
            first = next(((n, s.kind) for n, s in sources if s.provider == p.name), None)
            if first is not None and first[1] != p.api.kind:
                raise FieldProblem(
                    ("providers", i, "api", "kind"),
                    f"{p.api.kind}, but events source {first[0]} ({first[1]}) reads provider "
                    f"{p.name}'s webhooks: its messages carry the {first[1]} tag, which the "
                    f"{p.api.kind} log cannot be searched by",
                )
        return self
