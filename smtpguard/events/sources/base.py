"""What every source kind of §13 shares: the one verdict a request gets (`Verified` or
`Rejected`), the `Source` each kind implements, the timestamp tolerance, and the small
readers of a JSON body and its headers. No I/O here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from smtpguard.policy.events import Malformed, ProviderEvent


class Rejected(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Nonce:
    name: str
    digest: str
    until: float


@dataclass(frozen=True, slots=True)
class Verified:
    events: list[ProviderEvent]
    notice: str | None = None
    """Something the operator must act on (an SNS subscription to confirm by hand)."""
    nonce: Nonce | None = None
    """To be remembered by the store before the events apply (Store.remember_nonce)."""


class Source(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def provider(self) -> str:
        """The provider whose records this source's events may match."""

    @property
    def kind(self) -> str: ...

    def precheck(self, headers: Mapping[str, str]) -> None:
        """What can be refused before the body is read (missing signature headers, wrong
        Basic credentials): raises Rejected."""

    def verify(self, body: bytes, headers: Mapping[str, str], now: float) -> Verified: ...


@dataclass(frozen=True, slots=True)
class _Base:
    name: str
    provider: str
    tolerance: float

    def precheck(self, headers: Mapping[str, str]) -> None:
        return None

    def _fresh(self, at: float, now: float) -> None:
        if not math.isfinite(at) or abs(now - at) > self.tolerance:
            raise Rejected(401, "timestamp outside the tolerance (a replayed or delayed request)")

    def _fresh_seconds(self, timestamp: str, now: float, name: str) -> float:
        """The signed `timestamp`, Unix seconds in ASCII digits as the providers write them,
        if fresh. Nothing looser: Mailgun signs timestamp + token and SendGrid timestamp +
        body with no separator, so a reading that took `1764770000e0` (float() does) would
        let a captured signature verify over the same bytes split elsewhere: a new token
        and a body of anyone's choosing."""
        if not (timestamp.isascii() and timestamp.isdigit() and len(timestamp) <= 12):
            raise Rejected(401, f"{name} is not a Unix time in whole seconds")
        at = float(timestamp)
        self._fresh(at, now)
        return at


# --- small readers ---------------------------------------------------------------------------
def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        # RecursionError: nesting deeper than the parser's stack (`[[[[…`), before any check.
        raise Rejected(400, f"the body is not JSON: {type(e).__name__}") from None


def _json_object(body: bytes) -> dict[str, Any]:
    payload = _json(body)
    if not isinstance(payload, dict):
        raise Rejected(400, "the body is not a JSON object")
    return payload


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Malformed(f"{what} is not an object")
    return value


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if not value:
        raise Rejected(401, f"the {name} header is missing")
    return value


def _named_headers(items: Any) -> dict[str, str]:
    """[{name, value}, …] (SES mail.headers, Resend data.headers) as a lower-cased dict."""
    out: dict[str, str] = {}
    if isinstance(items, list):
        for item in items:
            if (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("value"), str)
            ):
                out.setdefault(item["name"].lower(), item["value"])
    elif isinstance(items, dict):
        out = {str(k).lower(): v for k, v in items.items() if isinstance(v, str)}
    return out
