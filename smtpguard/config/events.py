"""The listeners open to strangers: `events:` (webhook sources and the mailbox) and
`console:` with its operators."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from smtpguard.config.base import (
    Duration,
    FieldProblem,
    FilePath,
    Size,
    _host_port,
    _Listening,
    _Secret,
    _Strict,
    is_loopback,
    secret_when_needed,
)
from smtpguard.config.listener import TLSFiles
from smtpguard.config.zones import _argon2_hash
from smtpguard.policy import http_trust, verp
from smtpguard.policy.senders import address_problem


class _Source(_Strict):
    provider: str
    """The provider (providers[].name) this source's events come from: they match records
    relayed through it."""


class MailgunSource(_Source, _Secret):
    kind: Literal["mailgun"]
    signing_key_env: str | None = None
    signing_key_file: FilePath | None = None


class SendgridSource(_Source, _Secret):
    kind: Literal["sendgrid"]
    public_key_env: str | None = None
    """The Event Webhook's verification key: base64 DER of an ECDSA P-256 public key."""
    public_key_file: FilePath | None = None


class SvixSource(_Source, _Secret):
    kind: Literal["svix"]
    secret_env: str | None = None
    """The endpoint's signing secret, `whsec_…` (Resend and others deliver through Svix)."""
    secret_file: FilePath | None = None


class PostmarkSource(_Source, _Secret):
    kind: Literal["postmark"]
    username: str = Field(min_length=1)
    password_env: str | None = None
    password_file: FilePath | None = None


class SesSource(_Source):
    kind: Literal["ses"]
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


_VERP_DOMAIN = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+([A-Za-z]{2,63}|xn--[A-Za-z0-9-]{1,59})\.?$"
)


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
        if v is not None and len(v.rstrip(".")) > verp.DOMAIN_MAX:
            raise ValueError(
                f"VERP domain is longer than {verp.DOMAIN_MAX} characters: b+TOKEN@ it would pass "
                "RFC 5321's 256-octet envelope sender"
            )
        return v

    @model_validator(mode="after")
    def _verp_secret(self) -> MailboxConfig:
        secret_when_needed(self, "secret_env", "secret_file", needed_by="domain")
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


class ConsoleConfig(_Listening, SideListenerLimits):
    """The operator's console in the browser (DESIGN.md §14, §18)."""

    address: str = "127.0.0.1:9590"
    tls: TLSFiles | None = None
    session_ttl: Duration = 8 * 3600.0
    operators: list[OperatorConfig] = Field(default_factory=list)
    hosts: list[Annotated[str, AfterValidator(_console_host)]] = Field(default_factory=list)
    """Names (`name` or `name:port`) the console answers besides its listen address."""
    trusted_proxies: list[Annotated[str, AfterValidator(_proxy_network)]] = Field(default_factory=list)
    """Peers whose X-Forwarded-For names the client (CIDR or one address)."""

    @model_validator(mode="after")
    def _loopback_or_tls(self) -> ConsoleConfig:
        if self.tls is None and not is_loopback(self.host):
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
    def proxies(self) -> list[http_trust.Network]:
        return [http_trust.network(n) for n in self.trusted_proxies]
