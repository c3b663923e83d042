"""One provider event, as every source kind is reduced to, and the effects table of §13.

Pure: no I/O. The source modules turn a verified request into `ProviderEvent`s; `effect()`
says what each one does; the store applies it atomically.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from smtpguard.policy.senders import recipient_tag

KEY_FIELD = "smtpguard_key"
"""The custom variable (Mailgun user-variables, SendGrid unique_args, Postmark metadata)
that carries the zone-qualified event key back."""
ID_HEADER = "X-Smtpguard-Id"
"""Where the provider echoes the message's headers instead (SES, Resend, a DSN's returned
headers): the id of the attempt that sent it, which names its record. Not the key: these
headers reach the recipient, and a key often carries an order or customer id."""


ENCODED_TAG = "~b64:"
"""Prefix of a zone-qualified key written base64url-encoded (a key that is not printable
ASCII cannot be a header value). `~` is no zone name's first character, so no plain
`zone:key` reads as an encoded one."""
_TAG_MAX = 900
"""A tag longer than this would not fit an RFC 5322 line with its field name."""


def tag_value(qualified_key: str) -> str:
    """The value smtpguard writes as its tag: the key itself, or encoded, never none."""
    if qualified_key.isascii() and qualified_key.isprintable() and len(qualified_key) <= _TAG_MAX:
        return qualified_key
    raw = base64.urlsafe_b64encode(qualified_key.encode("utf-8", "surrogateescape"))
    return ENCODED_TAG + raw.decode("ascii").rstrip("=")


def key_of_tag(value: str) -> str | None:
    """The zone-qualified key a tag names (tag_value's inverse); None when it is malformed."""
    if not value.startswith(ENCODED_TAG):
        return value
    text = value[len(ENCODED_TAG) :]
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
        return raw.decode("utf-8", "surrogateescape") or None
    except (binascii.Error, ValueError):
        return None


_PUNCTUATION = re.compile(r"[\s_.\-]+")
_OUR_NAMES = re.compile(r"^(x)?(pmmetadata)?smtpguard(key|id)$")


def is_our_tag_name(name: str) -> bool:
    """Whether a header or custom-variable name is one of smtpguard's tag names in any case
    or punctuation (`X-Smtpguard-Id`, `smtpguard-key`, `SMTPGuard.Key`,
    `X-PM-Metadata-smtpguard-key`, …): a client's copy is removed before relay, since a
    provider may echo a look-alike as if it were ours."""
    return _OUR_NAMES.match(_PUNCTUATION.sub("", name.lower())) is not None


class Kind(StrEnum):
    """What an event means for smtpguard, whatever the provider calls it. Also the `type`
    label of smtpguard_provider_events_total, so the label's values are bounded."""

    BOUNCE = "bounce"
    """A hard (permanent) bounce: the address does not take mail."""
    COMPLAINT = "complaint"
    UNSUBSCRIBE = "unsubscribe"
    DELIVERED = "delivered"
    DEFERRED = "deferred"
    SOFT_BOUNCE = "soft_bounce"
    OTHER = "other"


SUPPRESSING = {Kind.BOUNCE, Kind.COMPLAINT, Kind.UNSUBSCRIBE}


class Malformed(Exception):
    """The request verified (or needs no signature) but is not what the source sends: 400."""


def strs(*values: object) -> tuple[str, ...]:
    """The values that are non-empty strings: ids as a provider's JSON gives them (a field
    may be missing, null or of another type), for a Match."""
    return tuple(v for v in values if isinstance(v, str) and v)


@dataclass(frozen=True, slots=True)
class Match:
    """How to find the ledger record an event is about, tried in this order (§13)."""

    keys: tuple[str, ...] = ()
    """Zone-qualified event keys (`zone:key`) the provider echoed back."""
    sg_ids: tuple[str, ...] = ()
    """smtpguard ids (the sending attempt's) echoed in the message's headers."""
    message_ids: tuple[str, ...] = ()
    upstream_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ProviderEvent:
    source: str
    kind: Kind
    provider_type: str
    """The provider's own name for it (`failed`, `bounce`, `email.bounced`, …)."""
    recipient: str | None
    status: str
    """The delivery status as the provider gave it (`5.1.1`, `550`, `HardBounce`), or ''."""
    at: float
    event_id: str
    match: Match = field(default_factory=Match)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """What the record's history keeps of an event (`events` in `history --json`)."""

    at: float
    source: str
    type: str
    provider_type: str
    recipient: str | None
    status: str
    id: str
    effect: str
    """`suppressed` (a suppressing event: its recipient is on the zone's list, put there
    now or earlier), `not_a_recipient` (a suppressing event naming an address the message
    was not sent to: kept, applied to nothing), or `history`."""
    received_at: float

    def to_dict(self) -> dict[str, Any]:
        # Every field is a plain value: the stored form is the fields, in their order.
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoredEvent:
        return cls(**d)


def suppression_reason(event: ProviderEvent) -> str | None:
    """The §13 effects table: the reason a suppressing event puts its recipient on the
    record's zone list with, or None when the event only joins the history."""
    if event.recipient is None or event.kind not in SUPPRESSING:
        return None
    if event.kind is Kind.BOUNCE:
        status = f" {event.status}" if event.status else ""
        return f"bounce{status} via {event.source}"
    return f"{event.kind.value} via {event.source}"


def effect_of(event: ProviderEvent, rcpt_tags: tuple[str, ...]) -> tuple[str | None, str]:
    """(the suppression reason or None, the effect kept in the history). Signed or not, an
    event suppresses only an address the message was sent to; records written before
    recipients were tagged carry no tags, and their events are trusted."""
    reason = suppression_reason(event)
    if reason is None:
        return None, "history"
    if event.recipient is not None and rcpt_tags and recipient_tag(event.recipient) not in rcpt_tags:
        return None, "not_a_recipient"
    return reason, "suppressed"


def content_id(payload: Any) -> str:
    """An id for an event the provider gave none: a hash of its canonical JSON, so the same
    event delivered again is recognised."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:40]


def bare_message_id(value: str) -> str:
    """A Message-ID compared without its angle brackets and surrounding space (§13)."""
    return value.strip().removeprefix("<").removesuffix(">").strip()
