"""The schema of DESIGN.md §19: `providers[].api`, `verdicts:` and `reconcile:`.

The verdict settings read as one piece here. The same strictness as the rest of the config:
unknown keys are errors, types are strict, and a secret is named by environment variable or
file, never written inline. The config's loader turns every error here into one naming its
YAML path and line.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from smtpguard.config.base import Duration, FilePath, _Secret, _Strict, is_loopback

MIN_EVERY = 30.0
"""Seconds: asking a provider's log more often than this per record only spends its rate
limit (SendGrid's Email Activity API allows 6 requests a minute)."""

DEFAULT_BASE_URLS = {
    "mailgun": "https://api.mailgun.net",
    "postmark": "https://api.postmarkapp.com",
    "sendgrid": "https://api.sendgrid.com",
}
"""Each provider's public API. EU regions: Mailgun https://api.eu.mailgun.net, SendGrid
https://api.eu.sendgrid.com."""


def _base_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"base_url {value!r} is not an http(s) URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"base_url {value!r} must not carry a query or fragment")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        # The API key travels in a header of every request.
        raise ValueError(f"base_url {value!r} is plain http to a host that is not loopback: use https")
    return value.rstrip("/")


class _Api(_Secret):
    _secret_noun = "key"

    base_url: str | None = None
    """Default: the provider's public API (DEFAULT_BASE_URLS)."""
    timeout: Duration = Field(10.0, gt=0, le=120)
    """Seconds for one request, connect to last byte."""
    max_connections: int = Field(4, ge=1, le=64)
    """Open connections to this API from one instance."""

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else _base_url(v)

    def url(self, kind: str) -> str:
        return self.base_url or DEFAULT_BASE_URLS[kind]


class MailgunApi(_Api):
    """Mailgun's Events API: GET {base_url}/v3/DOMAIN/events, Basic auth api:KEY."""

    kind: Literal["mailgun"]
    key_env: str | None = None
    key_file: FilePath | None = None
    domain: str = Field(min_length=1)
    """The sending domain whose events are read (mg.acme.example)."""

    @field_validator("domain")
    @classmethod
    def _domain(cls, v: str) -> str:
        if "/" in v or "?" in v or " " in v:
            raise ValueError(f"domain {v!r} is not a domain name")
        return v


class PostmarkApi(_Api):
    """Postmark's Messages and Bounces APIs, header X-Postmark-Server-Token."""

    kind: Literal["postmark"]
    token_env: str | None = None
    token_file: FilePath | None = None


class SendgridApi(_Api):
    """SendGrid's Email Activity and suppression APIs, Authorization: Bearer KEY."""

    kind: Literal["sendgrid"]
    key_env: str | None = None
    key_file: FilePath | None = None


ApiConfig = Annotated[MailgunApi | PostmarkApi | SendgridApi, Field(discriminator="kind")]


class VerdictsConfig(_Strict):
    """When the verdict loop asks a provider's log about an `unknown` record (§19)."""

    after: Duration = Field(120.0, gt=0)
    """First look, this long after the outcome turned unknown."""
    every: Duration = Field(300.0, ge=MIN_EVERY)
    absent_after: Duration = Field(1800.0, gt=0)
    """The earliest `not accepted` verdict: provider logs are eventually consistent."""
    give_up: Duration = Field(86400.0, gt=0)
    """Then no verdict: the record stays unknown for an operator."""

    @model_validator(mode="after")
    def _order(self) -> VerdictsConfig:
        if self.absent_after < self.after:
            raise ValueError(
                f"absent_after ({self.absent_after:g}s) is before the first look "
                f"(after: {self.after:g}s); no look could ever give `not accepted` that early"
            )
        if self.give_up <= self.absent_after:
            raise ValueError(
                f"give_up ({self.give_up:g}s) must be later than absent_after ({self.absent_after:g}s), "
                "or no record could ever be found not accepted"
            )
        return self


class ReconcileConfig(_Strict):
    events: Duration = Field(900.0, ge=60.0)
    """Poll each provider's API for bounces, complaints and unsubscribes this often."""


def api_problem(providers_with_api: int, reconcile: ReconcileConfig | None) -> str | None:
    """A whole-config check: reconciliation polls APIs, so it needs one."""
    if reconcile is not None and providers_with_api == 0:
        return "reconcile polls providers' APIs, and no provider has an `api:` section"
    return None
