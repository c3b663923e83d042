"""`event_key:`: the header(s) naming the business event, and how long smtpguard remembers it."""

from __future__ import annotations

import re

from pydantic import field_validator, model_validator

from smtpguard.config.base import Duration, FieldProblem, _Strict

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
