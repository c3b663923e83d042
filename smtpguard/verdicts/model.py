"""The calls every log-API client offers, and what reconciliation brings back."""

from __future__ import annotations

import math
from collections import Counter
from datetime import UTC, datetime
from typing import ClassVar, Protocol

from smtpguard.policy.events import Kind, ProviderEvent
from smtpguard.policy.utc import stamp
from smtpguard.policy.verdicts import Attempt, LogEntry

Reported = Kind
"""What reconciliation brings are the suppressing kinds of a provider event (§13: bounce,
complaint, unsubscribe): the webhook path's own enum, so that both paths name them alike."""


def api_source(provider: str) -> str:
    """The source name of events read from a provider's log API (`api:PROVIDER`), unless
    reconciliation stores them under the webhook source of the same provider."""
    return f"api:{provider}"


class LogApi(Protocol):
    provider: str
    kind: ClassVar[str]
    """The provider kind whose log this is (mailgun, sendgrid, postmark)."""
    log: str | None
    """Which log it reads (policy.verdicts.log_identity); None: it proves nothing absent."""
    errors: Counter[str]
    requests: int

    async def entries(self, attempt: Attempt) -> list[LogEntry]:
        """What the log holds within the attempt's time ± WINDOW that may be its message
        (the policy decides which match)."""
        ...

    async def accepted_since(self, at: float) -> list[LogEntry]:
        """A few acceptances logged after `at`, the earliest the API can give cheaply."""
        ...

    async def reported_since(self, since: float, until: float) -> list[ProviderEvent]:
        """Bounces, complaints and unsubscribes logged in [since, until), as the webhook path
        takes them (§13), each under `api_source(provider)` and an id of its own (the provider's
        id for the event, else one made of its fields): the same event read twice, or also
        brought by a webhook, is applied once."""
        ...

    async def close(self) -> None: ...


iso_utc = stamp
"""2017-10-13T18:56:21Z, the form SendGrid's and Postmark's examples use: the replies' own."""


def parse_time(value: object) -> float | None:
    """Unix seconds from epoch seconds or an ISO 8601 time (a zone-less one read as UTC);
    None for what is no instant. JSON as Python reads it spells NaN, Infinity and integers
    past any float: such a time compares with no window, so its entry would drop out of
    the look unnoticed instead of making it malformed (ApiClient.untimed)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            return None
        return seconds if math.isfinite(seconds) else None
    if not isinstance(value, str) or not value:
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()
