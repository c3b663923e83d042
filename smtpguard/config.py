"""Configuration: the schema of DESIGN.md §9, loaded from YAML and validated at load.

Every error names the YAML path and line (`zones.acme.users[0].password_hash (line 41): …`),
because an operator reading a failed `check-config` or a refused reload has only the file.
Unknown keys are errors: a misspelt `hourly_cap` must not silently mean "no cap".
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from smtpguard.policy.limits import PLANS
from smtpguard.policy.senders import address_problem
from smtpguard.units import parse_duration, parse_size

DEFAULT_CONFIG = "conf/smtpguard.yaml"

Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
_ZONE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class ConfigError(Exception):
    """A config that cannot be used; `problems` are one line each, with path and line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
            raise ValueError(
                "tls: none is allowed only on loopback addresses (AUTH would cross the network "
                "in clear); use starttls or implicit"
            )
        return self

    @property
    def host(self) -> str:
        return _host_port(self.address)[0]

    @property
    def port(self) -> int:
        return _host_port(self.address)[1]


class TLSFiles(_Strict):
    cert: Path
    key: Path


STORE_SCHEMES = ("sqlite:///", "redis://", "rediss://", "redis+sentinel://", "postgresql://", "postgres://")


class StoreWait(_Strict):
    """Redis only (DESIGN.md §15): every ledger write waits for `replicas` replicas (WAIT)
    before any upstream byte; fewer within `timeout` answer 451 4.3.0 and send nothing."""

    replicas: int = Field(ge=1)
    timeout: Duration = Field(0.2, gt=0)


class StoreConfig(_Strict):
    url: str = "sqlite:///var/smtpguard.db"
    password_env: str | None = None
    password_file: Path | None = None
    unsafe: bool = False
    """Serve on a store that may forget acknowledged writes (Redis without `appendonly yes`
    and `appendfsync always`, or with an evicting `maxmemory-policy`; PostgreSQL with
    `fsync` or `synchronous_commit` off): a forgotten reservation is a duplicate, so `serve`
    refuses such a store unless this is set (docs/stores.md)."""

    wait: StoreWait | None = None

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(STORE_SCHEMES):
            raise ValueError("store url must start with " + ", ".join(STORE_SCHEMES))
        return v

    @model_validator(mode="after")
    def _wait_is_for_redis(self) -> StoreConfig:
        if self.wait is not None and not self.url.startswith(("redis://", "rediss://", "redis+sentinel://")):
            raise ValueError("store.wait is for Redis (WAIT); PostgreSQL waits as synchronous_commit says")
        return self


class EventKeyConfig(_Strict):
    header: str = "X-Event-Key"
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


class SmtpProviderConfig(_Strict):
    name: str
    kind: Literal["smtp"]
    host: str
    port: int = Field(587, ge=1, le=65535)
    tls: Literal["starttls", "implicit", "none"] = "starttls"
    verify_tls: bool = True
    ca_file: Path | None = None
    username: str | None = None
    password_env: str | None = None
    password_file: Path | None = None
    timeouts: Timeouts = Timeouts()
    pool_size: int = Field(8, ge=1, le=256)
    idempotency_header: str | None = None
    helo_name: str | None = None

    @model_validator(mode="after")
    def _secret(self) -> SmtpProviderConfig:
        if self.password_env and self.password_file:
            raise ValueError("give password_env or password_file, not both")
        if self.username and not (self.password_env or self.password_file):
            raise ValueError("username needs password_env or password_file (never inline)")
        return self


class MaildirProviderConfig(_Strict):
    name: str
    kind: Literal["maildir"]
    path: Path


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
            raise ValueError(f"default_class {self.default_class!r} is not one of classes")
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


class UserConfig(_Strict):
    username: str = Field(min_length=1, max_length=128)
    password_hash: str

    @field_validator("password_hash")
    @classmethod
    def _hash(cls, v: str) -> str:
        if not v.startswith(("$argon2id$", "$argon2i$", "$argon2d$")):
            raise ValueError(
                "password_hash must be an argon2 hash from `smtpguard hash-password` "
                "(plaintext passwords are not accepted)"
            )
        return v


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
    signing_key_file: Path | None = None


class SendgridSource(_Secret):
    kind: Literal["sendgrid"]
    provider: str
    public_key_env: str | None = None
    """The Event Webhook's verification key: base64 DER of an ECDSA P-256 public key."""
    public_key_file: Path | None = None


class SvixSource(_Secret):
    kind: Literal["svix"]
    provider: str
    secret_env: str | None = None
    """The endpoint's signing secret, `whsec_…` (Resend and others deliver through Svix)."""
    secret_file: Path | None = None


class PostmarkSource(_Secret):
    kind: Literal["postmark"]
    provider: str
    username: str = Field(min_length=1)
    password_env: str | None = None
    password_file: Path | None = None


class SesSource(_Strict):
    kind: Literal["ses"]
    provider: str
    certificate_file: Path
    """The SNS signing certificate (PEM), downloaded once by the operator: smtpguard never
    fetches a SigningCertURL named by the request it is verifying."""
    topic_arn: str = Field(min_length=1)


EventSource = Annotated[
    MailgunSource | SendgridSource | SvixSource | PostmarkSource | SesSource, Field(discriminator="kind")
]
SOURCE_KINDS = ("mailgun", "sendgrid", "svix", "postmark", "ses")
_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class MailboxConfig(_Strict):
    """RFC 3464 DSNs and RFC 5965 ARF reports mailed to `address` at the `listen` listener."""

    listen: str
    address: str
    provider: str
    """Events from this mailbox match records relayed through this provider."""
    max_message_size: Size = 1_000_000

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        _host_port(v)
        return v

    @field_validator("address")
    @classmethod
    def _mailbox(cls, v: str) -> str:
        problem = address_problem(v)
        if problem:
            raise ValueError(f"mailbox address {v!r}: {problem}")
        return v


class EventsConfig(_Strict):
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
        return v


class Config(_Strict):
    listen: list[ListenerConfig] = Field(min_length=1)
    tls: TLSFiles | None = None
    store: StoreConfig = StoreConfig()
    event_key: EventKeyConfig = EventKeyConfig()
    limits: LimitsConfig = LimitsConfig()
    providers: list[ProviderConfig] = Field(min_length=1)
    breaker: BreakerConfig = BreakerConfig()
    queue: QueueConfig = QueueConfig()
    metrics: MetricsConfig | None = None
    events: EventsConfig | None = None
    log: LogConfig = LogConfig()
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """auto: uvloop when installed (the `fast` extra), else asyncio's own loop."""
    hostname: str | None = None
    """Name in the greeting and in derived Message-IDs; default: the machine's FQDN."""
    instance: str | None = None
    """This instance's name in leases and history; default: hostname and process id."""
    zones: dict[str, ZoneConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.tls is None and any(lst.tls != "none" for lst in self.listen):
            raise ValueError("a listener uses starttls or implicit TLS, so `tls: {cert, key}` is required")
        names = [p.name for p in self.providers]
        if len(set(names)) != len(names):
            raise ValueError("provider names must be unique")
        for zname in self.zones:
            if not _ZONE_NAME.match(zname) or zname == "global":
                raise ValueError(
                    f"zone name {zname!r} must be lower-case letters, digits, . _ - and not 'global'"
                )
        seen: dict[str, str] = {}
        for zname, zcfg in self.zones.items():
            for user in zcfg.users:
                if user.username in seen:
                    raise ValueError(
                        f"user {user.username!r} appears in zones {seen[user.username]} and {zname}"
                    )
                seen[user.username] = zname
            if zcfg.default_class and zcfg.default_class not in self.queue.classes:
                raise ValueError(f"zones.{zname}.default_class is not one of queue.classes")
        if self.events is not None:
            named = [(f"events.sources.{n}", s.provider) for n, s in self.events.sources.items()]
            if self.events.mailbox is not None:
                named.append(("events.mailbox", self.events.mailbox.provider))
            for where, provider in named:
                if provider not in names:
                    raise ValueError(
                        f"{where}.provider {provider!r} is not one of providers: {', '.join(names)}"
                    )
        return self

    def send_timeout(self) -> float:
        """The longest one relay can keep talking to providers after its last lease renewal:
        the whole route (a failover walks it), each SMTP provider's connect, its session's
        commands (EHLO to RSET) and DATA timeouts, twice for one that dedupes (an unknown
        outcome there is retried once). A Maildir write is bounded by the disk, not by a
        timeout: a minute is generous."""
        total = 0.0
        for p in self.providers:
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
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{source}{where}: invalid YAML: {problem}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the config must be a mapping of sections"])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError([_describe(err, node, source) for err in e.errors()]) from None


def _describe(err: Any, root: yaml.Node | None, source: str) -> str:
    loc = [part for part in err["loc"] if not _is_union_tag(part)]
    path = _dotted(loc)
    line = _line_of(root, loc)
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "missing":
        msg = "required key is missing"
    where = f"{source}: {path or '(top level)'}"
    if line:
        where += f" (line {line})"
    return f"{where}: {msg}"


def _is_union_tag(part: Any) -> bool:
    # pydantic inserts the discriminator value (`smtp`, `maildir`) into the location.
    return part in ("smtp", "maildir", *SOURCE_KINDS)


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
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(part):
                    nxt = v
                    line = k.start_mark.line + 1
                    break
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
            raise ConfigError([f"{what}: cannot read password_file {file}: {e.strerror}"]) from None
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
