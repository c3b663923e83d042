"""Configuration: the schema of DESIGN.md §9, loaded from YAML and validated at load.

Every error names the YAML path and line (`zones.acme.users[0].password_hash (line 41): …`),
because an operator reading a failed `check-config` or a refused reload has only the file.
Unknown keys are errors: a misspelt `hourly_cap` must not silently mean "no cap"; nor may a
second `acme:` silently replace the first (duplicate keys are refused with both lines), nor
`hourly_cap: "20"` or `paused: "on"` be read as a number or a flag (types are strict).

A model checking several fields together raises FieldProblem with the location of the field
at fault, relative to the model, so the error names that field's line, not the section's.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import types
import typing
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from smtpguard.policy import http_trust
from smtpguard.policy.limits import PLANS
from smtpguard.policy.senders import address_problem
from smtpguard.policy.throttle import CONNECTION_WAIT, RATE_WAIT
from smtpguard.units import parse_duration, parse_rate, parse_size
from smtpguard.verdict_config import ApiConfig, ReconcileConfig, VerdictsConfig, api_problem

DEFAULT_CONFIG = "conf/smtpguard.yaml"

Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
Rate = Annotated[float, BeforeValidator(parse_rate)]
"""Messages per second, written `10/s`, `600/m` or `36000/h`."""


def _path(value: object) -> object:
    # YAML has no path type: a string is the only spelling, and strict mode takes it here.
    return Path(value) if isinstance(value, str) and value else value


FilePath = Annotated[Path, BeforeValidator(_path)]
_ZONE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
MIN_PROBE_INTERVAL = 10.0
"""Seconds: a shorter probe_interval would log in to the provider many times a minute."""
MAX_WORKERS = 256


def _workers(value: object) -> object:
    # One message for both spellings, rather than one per member of the union.
    if value == "auto" or (type(value) is int and 1 <= value <= MAX_WORKERS):
        return value
    raise ValueError(f"must be a whole number from 1 to {MAX_WORKERS}, or auto; got {value!r}")


_DNS_LABELS = re.compile(r"[A-Za-z0-9_-]{1,63}(\.[A-Za-z0-9_-]{1,63})*")


class ConfigError(Exception):
    """A config that cannot be used; `problems` are one line each, with path and line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class FieldProblem(ValueError):
    """A problem with one field found by a model's own check (a cross-field rule): `loc` is
    the field's path inside the model that raises it, e.g. `("zones", "acme", "users", 0)`."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


class _Strict(BaseModel):
    # strict: YAML already has numbers and booleans; a quoted "20" or "on" is a mistake to
    # show, not a value to coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{value!r} is not host:port")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"{value!r} has no host")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ValueError(f"port {p} is out of range")
    return host, p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ListenerConfig(_Strict):
    address: str
    tls: Literal["starttls", "implicit", "none"] = "starttls"

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        _host_port(v)
        return v

    @model_validator(mode="after")
    def _clear_auth_only_on_loopback(self) -> ListenerConfig:
        if self.tls == "none" and not is_loopback(self.host):
            raise FieldProblem(
                ("tls",),
                "tls: none is allowed only on loopback addresses (AUTH would cross the network "
                "in clear); use starttls or implicit",
            )
        return self

    @property
    def host(self) -> str:
        return _host_port(self.address)[0]

    @property
    def port(self) -> int:
        return _host_port(self.address)[1]


class TLSFiles(_Strict):
    cert: FilePath
    key: FilePath


STORE_SCHEMES = ("sqlite:///", "redis://", "rediss://", "redis+sentinel://", "postgresql://", "postgres://")


class StoreWait(_Strict):
    """Redis only (DESIGN.md §15): every ledger write waits for `replicas` replicas (WAIT)
    before any upstream byte; fewer within `timeout` answer 451 4.3.0 and send nothing."""

    replicas: int = Field(ge=1)
    timeout: Duration = Field(0.2, gt=0)


class StoreConfig(_Strict):
    url: str = "sqlite:///var/smtpguard.db"
    password_env: str | None = None
    password_file: FilePath | None = None
    unsafe: bool = False
    """Serve on a store that may forget acknowledged writes (Redis without `appendonly yes`
    and `appendfsync always`, or with an evicting `maxmemory-policy`; PostgreSQL with
    `fsync` or `synchronous_commit` off): a forgotten reservation is a duplicate, so `serve`
    refuses such a store unless this is set (docs/stores.md)."""

    wait: StoreWait | None = None
    pool_size: int | None = Field(None, ge=1, le=1000)
    """PostgreSQL only: the most connections each process (each of `workers`) keeps to the
    server; default 32. The server's max_connections must cover pool_size * workers *
    instances, plus the CLI's and a migration's few (docs/stores.md)."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(STORE_SCHEMES):
            raise ValueError("store url must start with " + ", ".join(STORE_SCHEMES))
        if v.startswith(("postgresql://", "postgres://")):
            # As libpq reads it: hosts in the authority or a `host` parameter, and the last
            # of several target_session_attrs.
            hosts = v.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0].rsplit("@", 1)[-1]
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(v).query)
            hosts += ",".join(query.get("host", []))
            attrs = query.get("target_session_attrs", [""])[-1]
            if "," in hosts and attrs not in ("read-write", "primary"):
                raise ValueError(
                    "a store url naming several PostgreSQL hosts needs target_session_attrs=read-write "
                    "(else a connection may land on a standby, which refuses every write)"
                )
        return v

    @model_validator(mode="after")
    def _wait_is_for_redis(self) -> StoreConfig:
        if self.wait is not None and not self.url.startswith(("redis://", "rediss://", "redis+sentinel://")):
            raise ValueError("store.wait is for Redis (WAIT); PostgreSQL waits as synchronous_commit says")
        if self.pool_size is not None and not self.url.startswith(("postgresql://", "postgres://")):
            raise FieldProblem(("pool_size",), "store.pool_size is for PostgreSQL (a connection pool)")
        return self


_HEADER_NAME = re.compile(r"[\x21-\x39\x3b-\x7e]+")
_MESSAGE_FIELDS = frozenset(
    [
        "from",
        "sender",
        "reply-to",
        "to",
        "cc",
        "bcc",
        "message-id",
        "in-reply-to",
        "references",
        "subject",
        "date",
        "mime-version",
        "received",
        "return-path",
        "dkim-signature",
    ]
)
"""Fields the message itself needs (RFC 5322 §3.6, MIME, signatures): `event_key.strip`
must never cut them, so they cannot be key headers while it is on."""
_MESSAGE_FIELD_PREFIXES = ("content-", "resent-", "arc-")


class EventKeyConfig(_Strict):
    header: str | list[str] = "X-Event-Key"
    """One header, or aliases in order of preference (`[X-Event-Key, Idempotency-Key]`):
    the first present wins; two present with different values are refused (550 5.6.0)."""
    strip: bool = True
    """Remove every `header` from the message before relay (a provider with an
    `idempotency_header` still gets `NAME: ZONE:KEY`); false: the headers travel as sent."""
    retention: Duration = 30 * 86400.0
    inflight_wait: Duration = 10.0
    min_retry_interval: Duration = 60.0
    lease: Duration = 30.0

    @field_validator("retention")
    @classmethod
    def _retention(cls, v: float) -> float:
        # RFC 5321 §4.5.4.1: a client may retry for 4-5 days; a shorter memory would let a
        # late retry through as a new event.
        if v < 5 * 86400:
            raise ValueError("retention must be at least 5d (a retrying client may take 5 days)")
        return v

    @field_validator("lease")
    @classmethod
    def _lease(cls, v: float) -> float:
        if v < 1:
            raise ValueError("lease must be at least 1s")
        return v

    @field_validator("header")
    @classmethod
    def _header(cls, v: str | list[str]) -> str | list[str]:
        names = [v] if isinstance(v, str) else v
        if not names:
            raise ValueError("header needs at least one header name")
        for name in names:
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"header {name!r} is not a header field name (printable ASCII, no colon)")
        if len({n.lower() for n in names}) != len(names):
            raise ValueError("header names the same header twice (names are case-insensitive)")
        return v

    @model_validator(mode="after")
    def _strip_spares_the_message(self) -> EventKeyConfig:
        if self.strip:
            for name in self.headers:
                lname = name.lower()
                if lname in _MESSAGE_FIELDS or lname.startswith(_MESSAGE_FIELD_PREFIXES):
                    raise FieldProblem(
                        ("header",),
                        f"{name} is part of the message itself and strip (on by default) would "
                        "remove it before relay: name another header, or set strip: false",
                    )
        return self

    @property
    def headers(self) -> tuple[str, ...]:
        """Every configured key header, in order of preference."""
        return (self.header,) if isinstance(self.header, str) else tuple(self.header)


class LimitsConfig(_Strict):
    max_message_size: Size = 25_000_000
    max_recipients: int = Field(100, ge=1)
    auth_failures: int = Field(5, ge=1)
    auth_failure_window: Duration = 300.0
    max_connections: int = Field(1000, ge=1)
    max_connections_per_ip: int = Field(100, ge=1)
    idle_timeout: Duration = 300.0
    max_header_size: Size = 64 * 1024
    max_header_count: int = Field(500, ge=1)
    max_line_length: int = Field(1000, ge=1000, le=1_000_000)
    """Octets per command or DATA line, CRLF included (RFC 5321 §4.5.3.1.6 sets 1000 as the
    minimum a server must accept)."""
    data_timeout: Duration = Field(600.0, gt=0)
    """Cap on one DATA transfer from `354` to the final dot, however steadily a slow client
    trickles bytes; `idle_timeout` alone would let a slowloris hold the connection forever."""
    drain_timeout: Duration = 30.0


class Timeouts(_Strict):
    connect: Duration = 10.0
    command: Duration = 30.0
    data: Duration = 120.0


def _nameserver(value: str) -> tuple[str, int]:
    """`127.0.0.1`, `127.0.0.1:5353`, `[::1]:5353` or `::1`: an IP literal (a resolver's own
    name would need a resolver to find it) and an optional port, 53 by default."""
    text = value.strip()
    host, port = text, 53
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"{value!r}: unclosed [")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ValueError(f"{value!r} is not [host]:port")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        if not port_text.isdigit():
            raise ValueError(f"{value!r} is not host:port")
        port = int(port_text)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"nameserver {value!r} must be an IP address, optionally with :port") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    return host, port


class DnsConfig(_Strict):
    """The resolver every lookup uses (doctor's checks, the RCPT recipient-domain check).
    Without `nameservers`, the system's (/etc/resolv.conf)."""

    nameservers: list[str] = Field(default_factory=list)
    timeout: Duration = Field(2.0, gt=0)
    """The whole lookup, every nameserver tried included: RCPT waits at most this long."""

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, v: list[str]) -> list[str]:
        for ns in v:
            _nameserver(ns)
        return v

    def servers(self) -> list[tuple[str, int]]:
        return [_nameserver(ns) for ns in self.nameservers]


def _spf_term(value: str) -> str:
    term = value.strip()
    if not term or " " in term:
        raise ValueError(f"spf must be one SPF mechanism such as include:mailgun.org, not {value!r}")
    return term


class SmtpProviderConfig(_Strict):
    name: str
    kind: Literal["smtp"]
    host: str
    port: int = Field(587, ge=1, le=65535)
    tls: Literal["starttls", "implicit", "none"] = "starttls"
    verify_tls: bool = True
    ca_file: FilePath | None = None
    username: str | None = None
    password_env: str | None = None
    password_file: FilePath | None = None
    timeouts: Timeouts = Timeouts()
    pool_size: int = Field(8, ge=1, le=256)
    idempotency_header: str | None = None
    helo_name: str | None = None
    spf: Annotated[str, BeforeValidator(_spf_term)] | None = None
    """The SPF mechanism that authorises this provider in a sender domain's record
    (`include:mailgun.org`); doctor looks for it through the include tree."""
    spf_subdomain: str | None = None
    """Where the provider's SPF record must be, below each sender domain: the return-path
    (envelope-from) subdomain the provider sends with, e.g. `send` for `send.acme.example`.
    Absent: the sender domain's own record."""
    dkim_selectors: list[str] = Field(default_factory=list)
    """SELECTOR._domainkey.DOMAIN must publish a key for every sender domain."""
    probe_interval: Duration | None = Field(None, ge=MIN_PROBE_INTERVAL)
    """serve probes the provider this often (connect, EHLO, STARTTLS, AUTH, QUIT; never
    MAIL); off when absent."""
    share: float = Field(0.0, ge=0.0, le=1.0)
    """On a standby: this share of relayed mail goes through it while it is ready, chosen
    by event key so that a retry takes the same route."""
    max_rate: Rate | None = None
    """Messages per second to this provider from every instance sharing the store together
    (DESIGN.md §16); unlimited when absent."""
    max_connections: int | None = Field(None, ge=1)
    """Open connections to this provider from every instance together; each instance's
    pool_size still bounds its own."""
    throttle_backoff: Duration = Field(60.0, gt=0)
    """How long a rate-limit reply (421, or 451 4.7.x saying rate/too many) keeps every
    instance off this provider, instead of counting against its circuit."""
    api: ApiConfig | None = None
    """The provider's log API, asked for verdicts and reconciliation (DESIGN.md §19)."""

    @field_validator("dkim_selectors")
    @classmethod
    def _selectors(cls, v: list[str]) -> list[str]:
        for sel in v:
            if not _DNS_LABELS.fullmatch(sel):
                raise ValueError(f"dkim selector {sel!r} is not a DNS label")
            if "_domainkey" in sel.lower().split("."):
                # doctor looks up SELECTOR._domainkey.DOMAIN itself
                alone = sel.lower().split("._domainkey", 1)[0]
                raise ValueError(
                    f"dkim selector {sel!r} includes ._domainkey: give the selector alone ({alone!r})"
                )
        return v

    @field_validator("spf_subdomain")
    @classmethod
    def _spf_subdomain(cls, v: str | None) -> str | None:
        if v is not None and not _DNS_LABELS.fullmatch(v.strip(".")):
            raise ValueError(f"spf_subdomain {v!r} is not DNS labels (e.g. send, or bounces.mail)")
        return v.strip(".").lower() if v else v

    @model_validator(mode="after")
    def _secret(self) -> SmtpProviderConfig:
        if self.password_env and self.password_file:
            raise FieldProblem(("password_file",), "give password_env or password_file, not both")
        if self.username and not (self.password_env or self.password_file):
            raise FieldProblem(("username",), "username needs password_env or password_file (never inline)")
        if self.share and self.probe_interval is None:
            # The share goes only to a standby that answers its probes: without them smtpguard
            # cannot know it is ready, and an untested standby is what the share is meant to avoid.
            raise FieldProblem(
                ("share",), "share needs probe_interval (the share goes only to a ready provider)"
            )
        return self


class MaildirProviderConfig(_Strict):
    name: str
    kind: Literal["maildir"]
    path: FilePath
    max_rate: Rate | None = None
    """As for an SMTP provider: messages per second written by every instance together
    (staging that mimics a provider's limit). A Maildir never answers a rate limit and
    holds no connection, so it has neither throttle_backoff nor max_connections."""


ProviderConfig = Annotated[SmtpProviderConfig | MaildirProviderConfig, Field(discriminator="kind")]


class BreakerConfig(_Strict):
    failure_threshold: int = Field(5, ge=1)
    cooldown: Duration = 30.0


class Backoff(_Strict):
    base: Duration = 60.0
    max: Duration = 3600.0


class MessageClass(_Strict):
    max_age: Duration
    priority: int = Field(ge=0)


class QueueConfig(_Strict):
    backoff: Backoff = Backoff()
    workers: int = Field(16, ge=1, le=1024)
    """Deliveries in flight at once per instance (bounded further by each provider's pool)."""
    poll_interval: Duration = Field(1.0, gt=0)
    """How often an idle worker looks for due entries (other instances' acceptances, retries
    coming due); a local acceptance wakes it at once."""
    class_header: str = "X-Message-Class"
    default_class: str = "transactional"
    classes: dict[str, MessageClass] = Field(
        default_factory=lambda: {
            "otp": MessageClass(max_age=600, priority=0),
            "transactional": MessageClass(max_age=3 * 86400, priority=1),
            "bulk": MessageClass(max_age=86400, priority=2),
        }
    )

    @model_validator(mode="after")
    def _default_known(self) -> QueueConfig:
        if self.default_class not in self.classes:
            raise FieldProblem(
                ("default_class",),
                f"default_class {self.default_class!r} is not one of classes "
                f"({', '.join(sorted(self.classes))})",
            )
        return self


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


def _argon2_hash(v: str) -> str:
    if not v.startswith(("$argon2id$", "$argon2i$", "$argon2d$")):
        raise ValueError(
            "password_hash must be an argon2 hash from `smtpguard hash-password` "
            "(plaintext passwords are not accepted)"
        )
    return v


class UserConfig(_Strict):
    username: str = Field(min_length=1, max_length=128)
    password_hash: str | None = None
    password_hashes: list[str] | None = Field(None, min_length=1)
    """During a rotation, `[new, old]`: AUTH succeeds with any; give this or password_hash."""
    hourly_cap: int | None = Field(None, ge=0)
    """The user's own caps inside the zone's (DESIGN.md §16): one internal service cannot
    spend the whole zone's budget."""
    monthly_cap: int | None = Field(None, ge=0)

    @field_validator("password_hash")
    @classmethod
    def _hash(cls, v: str | None) -> str | None:
        return None if v is None else _argon2_hash(v)

    @field_validator("password_hashes")
    @classmethod
    def _hashes(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            for h in v:
                _argon2_hash(h)
            if len(set(v)) != len(v):
                # Each costs a verification on every failed AUTH, for every user.
                raise ValueError("password_hashes lists the same hash twice")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> UserConfig:
        if (self.password_hash is None) == (self.password_hashes is None):
            raise ValueError("give exactly one of password_hash or password_hashes (a list, in a rotation)")
        return self

    @property
    def hashes(self) -> tuple[str, ...]:
        """Every hash AUTH may match, in the order given (the new one first)."""
        if self.password_hashes is not None:
            return tuple(self.password_hashes)
        assert self.password_hash is not None
        return (self.password_hash,)


def _check_or_off(value: object) -> object:
    # The loader reads YAML 1.2 booleans: `false` is False (off, as documented), `true` is
    # True (a flag the setting does not take); `on`, `yes` and `no` stay strings.
    if value is False:
        return "off"
    if value is True:
        raise ValueError("recipient_domains is true: write check (or off)")
    if value not in ("check", "off"):
        raise ValueError(f"recipient_domains is {value!r}: write check or off")
    return value


def _host_name(value: str) -> str:
    return value.strip().rstrip(".").lower()


class ZoneConfig(_Strict):
    plan: Literal["free", "solo", "starter", "business", "agency", "unlimited"] = "solo"
    hourly_cap: int | None = Field(None, ge=0)
    monthly_cap: int | None = Field(None, ge=0)
    missing_key: Literal["reject", "derive", "allow"] = "reject"
    derive_window: Duration = 600.0
    delivery: Literal["relay", "queue"] = "relay"
    default_class: str | None = None
    paused: bool = False
    senders: list[str] = Field(default_factory=list)
    users: list[UserConfig] = Field(default_factory=list)
    recipient_domains: Annotated[Literal["check", "off"], BeforeValidator(_check_or_off)] = "off"
    """check: RCPT refuses a recipient domain with a null MX (556 5.1.10) or that cannot
    receive mail (550 5.1.2); DNS trouble accepts (DESIGN.md §3, §12)."""
    mx: list[Annotated[str, BeforeValidator(_host_name)]] | None = None
    """The MX hosts the zone's sender domains should have; doctor warns about any other."""
    alert_at: list[float] = Field(default_factory=list)
    """Shares of a cap (0 < x <= 1, ascending) whose crossing logs one warning per window
    (clock hour for the hourly cap, month for the monthly): `[0.8, 0.95]`."""

    @field_validator("alert_at")
    @classmethod
    def _alert_at(cls, v: list[float]) -> list[float]:
        for x in v:
            if not 0 < x <= 1:
                raise ValueError(f"alert_at {x} is not a share of the cap: each must be > 0 and <= 1")
        if v != sorted(set(v)):
            raise ValueError("alert_at must be ascending with no repeats, e.g. [0.8, 0.95]")
        return v

    providers: list[str] | None = Field(None, min_length=1)
    """This zone's route, by provider name, in order (DESIGN.md §16): reorders or restricts
    the top-level providers for this zone. Absent: the top-level route."""

    @field_validator("senders")
    @classmethod
    def _senders(cls, v: list[str]) -> list[str]:
        for alias in v:
            probe = "x" + alias if alias.startswith("@") else alias
            problem = address_problem(probe)
            if problem:
                raise ValueError(f"sender alias {alias!r}: {problem}")
        return v


class _Secret(_Strict):
    """A secret named by environment variable or file, never inline."""

    @model_validator(mode="after")
    def _one_secret(self) -> _Secret:
        fields = [f for f in type(self).model_fields if f.endswith(("_env", "_file"))]
        given = [f for f in fields if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {' or '.join(fields)} (never the secret inline)")
        return self


class MailgunSource(_Secret):
    kind: Literal["mailgun"]
    provider: str
    signing_key_env: str | None = None
    signing_key_file: FilePath | None = None


class SendgridSource(_Secret):
    kind: Literal["sendgrid"]
    provider: str
    public_key_env: str | None = None
    """The Event Webhook's verification key: base64 DER of an ECDSA P-256 public key."""
    public_key_file: FilePath | None = None


class SvixSource(_Secret):
    kind: Literal["svix"]
    provider: str
    secret_env: str | None = None
    """The endpoint's signing secret, `whsec_…` (Resend and others deliver through Svix)."""
    secret_file: FilePath | None = None


class PostmarkSource(_Secret):
    kind: Literal["postmark"]
    provider: str
    username: str = Field(min_length=1)
    password_env: str | None = None
    password_file: FilePath | None = None


class SesSource(_Strict):
    kind: Literal["ses"]
    provider: str
    certificate_file: FilePath
    """The SNS signing certificate (PEM), downloaded once by the operator: smtpguard never
    fetches a SigningCertURL named by the request it is verifying. The file may hold
    several (the current one and the next, while AWS rotates it)."""
    topic_arn: str = Field(min_length=1)


EventSource = Annotated[
    MailgunSource | SendgridSource | SvixSource | PostmarkSource | SesSource, Field(discriminator="kind")
]
SOURCE_KINDS = ("mailgun", "sendgrid", "svix", "postmark", "ses")
_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


_VERP_DOMAIN = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}\.?$")


class SideListenerLimits(_Strict):
    """Limits of a listener open to strangers: the events webhooks, the console, the
    mailbox (DESIGN.md §18; smtpguard/admission.py)."""

    max_connections: int = Field(256, ge=1)
    max_connections_per_ip: int = Field(32, ge=1)
    """Counted per IPv4 address and per IPv6 /64."""
    read_timeout: Duration = Field(10.0, gt=0)
    """From a request's (a command's) first byte to its last, body included."""
    idle_timeout: Duration = Field(15.0, gt=0)
    """A connection that sends nothing this long is closed (HTTP keep-alive included)."""


class MailboxConfig(SideListenerLimits):
    """RFC 3464 DSNs and RFC 5965 ARF reports mailed to `address` at the `listen` listener."""

    listen: str
    address: str
    provider: str
    """Events from this mailbox match records relayed through this provider."""
    max_message_size: Size = 1_000_000
    domain: str | None = None
    """The VERP domain (DESIGN.md §18), whose MX points at this listener: relayed mail
    leaves with the envelope sender `b+TOKEN@DOMAIN`, and only a report mailed to a token
    that verifies has effects. Without it, reports join a record's history only."""
    secret_env: str | None = None
    """The secret the tokens are signed with (HMAC-SHA256); needed with `domain`."""
    secret_file: FilePath | None = None

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        _host_port(v)
        return v

    @field_validator("domain")
    @classmethod
    def _domain(cls, v: str | None) -> str | None:
        if v is not None and not _VERP_DOMAIN.match(v):
            raise ValueError(f"VERP domain {v!r} is not a DNS name (letters, digits, - and .)")
        return v

    @model_validator(mode="after")
    def _verp_secret(self) -> MailboxConfig:
        if self.secret_env and self.secret_file:
            raise FieldProblem(("secret_file",), "give secret_env or secret_file, not both")
        if self.domain and not (self.secret_env or self.secret_file):
            raise FieldProblem(("domain",), "domain needs secret_env or secret_file (never inline)")
        return self

    @field_validator("address")
    @classmethod
    def _mailbox(cls, v: str) -> str:
        problem = address_problem(v)
        if problem:
            raise ValueError(f"mailbox address {v!r}: {problem}")
        return v


class EventsConfig(SideListenerLimits):
    address: str | None = None
    """The webhook listener (HTTP; put TLS in front of it, as for any webhook receiver)."""
    max_body: Size = 1_000_000
    tolerance: Duration = 300.0
    """Signed timestamps further from the store's clock than this are refused (replay)."""
    sources: dict[str, EventSource] = Field(default_factory=dict)
    mailbox: MailboxConfig | None = None

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None:
            _host_port(v)
        return v

    @field_validator("sources")
    @classmethod
    def _names(cls, v: dict[str, EventSource]) -> dict[str, EventSource]:
        for name in v:
            if not _SOURCE_NAME.match(name):
                raise ValueError(f"source name {name!r} must be letters, digits, . _ - (it is a URL path)")
            if name == "mailbox":
                raise ValueError("source name 'mailbox' is the events mailbox's own; choose another")
        return v


class OperatorConfig(_Strict):
    username: str = Field(min_length=1, max_length=64)
    password_hash: str
    role: Literal["operator", "viewer"] = "viewer"

    @field_validator("password_hash")
    @classmethod
    def _hash(cls, v: str) -> str:
        return _argon2_hash(v)


def _console_host(value: str) -> str:
    http_trust.host_port(value)
    return value


def _proxy_network(value: str) -> str:
    http_trust.network(value)
    return value


class ConsoleConfig(SideListenerLimits):
    """The operator's console in the browser (DESIGN.md §14, §18)."""

    address: str = "127.0.0.1:9590"
    tls: TLSFiles | None = None
    session_ttl: Duration = 8 * 3600.0
    operators: list[OperatorConfig] = Field(default_factory=list)
    hosts: list[Annotated[str, AfterValidator(_console_host)]] = Field(default_factory=list)
    """Names (`name` or `name:port`) the console answers besides its listen address."""
    trusted_proxies: list[Annotated[str, AfterValidator(_proxy_network)]] = Field(default_factory=list)
    """Peers whose X-Forwarded-For names the client (CIDR or one address)."""

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        _host_port(v)
        return v

    @model_validator(mode="after")
    def _loopback_or_tls(self) -> ConsoleConfig:
        if self.tls is None and not is_loopback(_host_port(self.address)[0]):
            raise FieldProblem(
                ("address",),
                "console.address is not loopback, so console.tls is required "
                "(passwords and session cookies would cross the network in clear)",
            )
        names = [o.username for o in self.operators]
        if len(set(names)) != len(names):
            raise FieldProblem(("operators",), "console.operators usernames must be unique")
        return self

    @property
    def host(self) -> str:
        return _host_port(self.address)[0]

    @property
    def port(self) -> int:
        return _host_port(self.address)[1]

    @property
    def proxies(self) -> list[http_trust.Network]:
        return [http_trust.network(n) for n in self.trusted_proxies]


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
    workers_heartbeat: Duration = Field(30.0, ge=1.0, le=3600.0)
    """With workers: a worker whose event loop answers no heartbeat for this long is killed
    and replaced (DESIGN.md §18)."""
    zones: dict[str, ZoneConfig] = Field(min_length=1)

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
    def _verdict_checks(self) -> Config:
        with_api = sum(1 for p in self.providers if isinstance(p, SmtpProviderConfig) and p.api is not None)
        problem = api_problem(with_api, self.reconcile)
        if problem:
            raise FieldProblem(("reconcile",), problem)
        return self


# --- loading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadedConfig:
    config: Config
    path: Path


def load(path: str | os.PathLike[str]) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{p}: no such file"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{p}: cannot read: {e}"]) from None
    return loads(text, str(p))


def loads(text: str, source: str = "<config>") -> Config:
    node, data = parse_yaml(text, source)
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the config must be a mapping of sections"])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError([_describe(err, node, source) for err in e.errors()]) from None


# --- YAML ------------------------------------------------------------------------------------
_YAML_BASE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_YAML_BASE):  # type: ignore[misc,valid-type]
    """PyYAML's safe loader with YAML 1.2 booleans: only true/false are flags. YAML 1.1's
    yes/no/on/off stay strings, so `paused: on` is refused rather than read as true, and a
    country code `NO` in a list stays `NO`."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def parse_yaml(text: str, source: str = "<config>") -> tuple[yaml.Node | None, Any]:
    """The document's node tree (for line numbers) and its data; refuses duplicate keys.

    PyYAML keeps the last of two equal keys; here both lines are named instead. This is a
    walk over the node tree PyYAML composes anyway, so no second YAML library is needed."""
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError([f"{source}: nested too deeply"]) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError([f"{source}{where}: invalid YAML: {problem}"]) from None
        if node is None:
            return None, None
        try:
            duplicates = _duplicate_keys(node)
        except _TooDeep as e:
            raise ConfigError([f"{source} (line {e.line}): nested too deeply"]) from None
        if duplicates:
            raise ConfigError([f"{source}: {d}" for d in duplicates])
        try:
            data = loader.construct_document(node)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError([f"{source}{where}: invalid YAML: {getattr(e, 'problem', e)}"]) from None
        return node, data
    finally:
        loader.dispose()


_MAX_DEPTH = 64
"""No config section nests anywhere near this deep; past it, a document is refused before
anything walks it recursively."""
_MERGE = "tag:yaml.org,2002:merge"


class _TooDeep(Exception):
    def __init__(self, line: int) -> None:
        self.line = line


def _duplicate_keys(root: yaml.Node) -> list[str]:
    """Every key given twice in one mapping, including inside a merge (`<<:`) value; a walk
    with its own stack, so depth costs no recursion. Raises _TooDeep past _MAX_DEPTH."""
    out: list[str] = []
    seen: set[int] = set()
    todo: list[tuple[yaml.Node, str, int]] = [(root, "", 0)]
    while todo:
        node, path, depth = todo.pop()
        if id(node) in seen:  # an alias: its node was checked where the anchor is
            continue
        seen.add(id(node))
        if depth > _MAX_DEPTH:
            raise _TooDeep(node.start_mark.line + 1)
        children: list[tuple[yaml.Node, str, int]] = []
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode):
                    continue
                if k.tag == _MERGE:
                    # The merged mapping (or list of them) is checked as part of this one's path.
                    children.append((v, path, depth + 1))
                    continue
                line = k.start_mark.line + 1
                here = f"{path}.{k.value}" if path else str(k.value)
                if k.value in lines:
                    out.append(
                        f"{here} (lines {lines[k.value]} and {line}): duplicate key; "
                        "YAML would keep only the second, silently"
                    )
                else:
                    lines[k.value] = line
                children.append((v, here, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            children = [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.value)]
        todo.extend(reversed(children))
    return out


# --- errors ----------------------------------------------------------------------------------
_TYPE_NAMES = {
    "bool_type": "true or false",
    "int_type": "a whole number",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


_BOUNDS = {
    "greater_than_equal": ("at least", "ge"),
    "greater_than": ("more than", "gt"),
    "less_than_equal": ("at most", "le"),
    "less_than": ("less than", "lt"),
}


def _describe(err: Any, root: yaml.Node | None, source: str, schema: type[BaseModel] | None = None) -> str:
    raw_loc = list(err["loc"])
    problem = (err.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        raw_loc += list(problem.loc)
    loc, union = _strip_union_tags(schema or Config, raw_loc)
    path = _dotted(loc)
    line = _line_of(root, loc)
    msg = str(err["msg"]).removeprefix("Value error, ")
    kind = err["type"]
    if kind == "extra_forbidden":
        msg = "unknown key"
        known = _known_keys(schema or Config, raw_loc[:-1])
        close = difflib.get_close_matches(str(raw_loc[-1]), known, n=1, cutoff=0.6)
        if close:
            msg += f"; did you mean `{close[0]}`?"
    elif kind == "missing":
        msg = "required key is missing"
    elif kind in ("union_tag_not_found", "union_tag_invalid"):
        disc = str((err.get("ctx") or {}).get("discriminator", "kind")).strip("'")
        tags = ", ".join(union)
        if kind == "union_tag_not_found":
            msg = f"`{disc}` is missing; say which kind this is: one of {tags}"
        else:
            msg = f"{disc} {err['ctx']['tag']!r} is not a known kind; one of {tags}"
            line = _line_of(root, [*loc, disc]) or line
    elif kind in _BOUNDS:
        ctx = err.get("ctx") or {}
        word, name = _BOUNDS[kind]
        msg = f"must be {word} {ctx.get(name)}, got {_shown(loc, err.get('input'))}"
    elif kind in ("too_short", "string_too_short"):
        n = (err.get("ctx") or {}).get("min_length")
        msg = "must not be empty" if n == 1 else f"needs at least {n} entries"
    elif kind == "literal_error":
        expected = str((err.get("ctx") or {}).get("expected", "")).replace("'", "")
        msg = f"{_shown(loc, err.get('input'))} is not one of: {expected.replace(' or ', ', ')}"
    elif kind == "is_instance_of" and (err.get("ctx") or {}).get("class") == "Path":
        msg = f"expected a file path, got {_shown(loc, err.get('input'))}"
    elif kind in _TYPE_NAMES:
        got = err.get("input")
        msg = f"expected {_TYPE_NAMES[kind]}, got {_shown(loc, got)}"
        if isinstance(got, str) and _unquoted_would_do(kind, got):
            msg += " (a quoted string: write it without quotes)"
        elif kind == "bool_type" and isinstance(got, str):
            msg += " (yes/no/on/off are strings here: write true or false)"
    where = f"{source}: {path or '(top level)'}"
    if line:
        where += f" (line {line})"
    return f"{where}: {msg}"


_SECRET_FIELD = re.compile(r"password|secret|key", re.IGNORECASE)
_SHOWN_MAX = 60


def _shown(loc: list[Any], value: object) -> str:
    """A refused value as an error may echo it: hidden under a field that may hold a secret
    (password…, …secret…, …key…), cut short when long."""
    field = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
    if _SECRET_FIELD.search(field) and field != "missing_key":
        return "(a value, not shown)"
    text = repr(value)
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 1] + "…"


def _unquoted_would_do(kind: str, text: str) -> bool:
    if kind == "bool_type":
        return text.lower() in ("true", "false")
    try:
        (int if kind == "int_type" else float)(text)
    except ValueError:
        return False
    return kind in ("int_type", "float_type")


def _unwrap(tp: Any) -> Any:
    """The type under Annotated and Optional."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return tp


def _union_members(tp: Any) -> list[type[BaseModel]] | None:
    """The models of a discriminated union (providers' `kind`), else None."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return None
    members = [_unwrap(a) for a in typing.get_args(tp) if a is not type(None)]
    if not all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
        return None
    return members


def _tags(model: type[BaseModel], members: list[type[BaseModel]]) -> list[str]:
    """The values `model` takes in the union's discriminator: the field that is a Literal
    in every member (`kind`)."""
    for name, f in model.model_fields.items():
        if all(
            typing.get_origin(getattr(m.model_fields.get(name), "annotation", None)) is Literal
            for m in members
        ):
            return [str(a) for a in typing.get_args(f.annotation)]
    return []


def _step(tp: Any, part: Any) -> Any:
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        field = tp.model_fields.get(str(part))
        return field.annotation if field is not None else None
    origin = typing.get_origin(tp)
    if origin in (list, tuple) and isinstance(part, int):
        return typing.get_args(tp)[0]
    if origin is dict:
        return typing.get_args(tp)[1]
    return None


def _strip_union_tags(schema: type[BaseModel], loc: list[Any]) -> tuple[list[Any], list[str]]:
    """pydantic puts a discriminated union's tag (`smtp`) into the location; walking the
    schema tells a tag from a key of the same spelling (a zone named `smtp`). Returns the
    location without tags and the tags of the last union met."""
    out: list[Any] = []
    tags: list[str] = []
    tp: Any = schema
    for part in loc:
        members = _union_members(_unwrap(tp)) if tp is not None else None
        if members is not None:
            tags = [t for m in members for t in _tags(m, members)]
            chosen = next((m for m in members if str(part) in _tags(m, members)), None)
            if chosen is not None:
                tp = chosen
                continue
        out.append(part)
        tp = _step(tp, part) if tp is not None else None
    if tp is not None and (members := _union_members(_unwrap(tp))) is not None:
        tags = [t for m in members for t in _tags(m, members)]
    return out, tags


def _known_keys(schema: type[BaseModel], loc: list[Any]) -> list[str]:
    """The keys the model at `loc` (a location as pydantic gives it, tags included) knows."""
    tp: Any = schema
    for part in loc:
        members = _union_members(_unwrap(tp))
        if members is not None:
            tp = next((m for m in members if str(part) in _tags(m, members)), None)
        else:
            tp = _step(tp, part)
        if tp is None:
            return []
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _dotted(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_of(node: yaml.Node | None, loc: list[Any]) -> int | None:
    """The line of the deepest YAML node the error location reaches."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            # The last match: after a merge (`<<:`) PyYAML puts the merged pairs first, and
            # the key that overrides one of them is the one that counts.
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(part):
                    nxt = v
                    line = k.start_mark.line + 1
            if nxt is None:
                return line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


# --- secrets ---------------------------------------------------------------------------------
def read_secret(env: str | None, file: Path | None, what: str) -> str | None:
    """A secret from the environment or a file (trailing newline stripped); never inline."""
    if env:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError([f"{what}: environment variable {env} is not set"])
        return value
    if file:
        try:
            return file.read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as e:
            raise ConfigError([f"{what}: cannot read {file}: {e.strerror}"]) from None
    return None


def provider_secrets(config: Config) -> dict[str, str | None]:
    """Resolve every provider's password now, so a missing one fails at start, not at send."""
    out: dict[str, str | None] = {}
    problems: list[str] = []
    for i, p in enumerate(config.providers):
        if isinstance(p, SmtpProviderConfig):
            try:
                out[p.name] = read_secret(p.password_env, p.password_file, f"providers[{i}]")
            except ConfigError as e:
                problems.extend(e.problems)
        else:
            out[p.name] = None
    if problems:
        raise ConfigError(problems)
    return out


def plan_send_as(zone: ZoneConfig) -> bool:
    return PLANS[zone.plan].send_as


def worker_count(workers: int | Literal["auto"]) -> int:
    """`workers: auto` is the cores this process may run on (its CPU affinity, which a
    container's cpuset narrows), else every core the machine has."""
    if workers != "auto":
        return workers
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))
