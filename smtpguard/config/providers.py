"""`providers:` (SMTP and Maildir, told apart by `kind`) and the `breaker:` over them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from smtpguard.config.base import (
    _DNS_LABELS,
    Duration,
    FieldProblem,
    FilePath,
    Rate,
    _Strict,
    secret_when_needed,
)
from smtpguard.config.verdicts import ApiConfig

MIN_PROBE_INTERVAL = 10.0
"""Seconds: a shorter probe_interval would log in to the provider many times a minute."""


class Timeouts(_Strict):
    connect: Duration = 10.0
    command: Duration = 30.0
    data: Duration = 120.0


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
        secret_when_needed(self, "password_env", "password_file", needed_by="username")
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
