"""The business event key: taken from its header, validated, or derived (DESIGN.md §4)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from smtpguard import replies
from smtpguard.policy.message import Message
from smtpguard.replies import Reply

MAX_KEY_LENGTH = 200
MissingKeyMode = Literal["reject", "derive", "allow"]


@dataclass(frozen=True, slots=True)
class EventKey:
    value: str
    derived: bool


def key_problem(value: str) -> str | None:
    """Why a key is unusable, or None. Whitespace is refused so folding cannot alter a key."""
    if not value:
        return "the key is empty"
    if len(value) > MAX_KEY_LENGTH:
        return f"the key is longer than {MAX_KEY_LENGTH} characters"
    if any(c.isspace() or not c.isprintable() for c in value):
        return "the key contains whitespace or control characters"
    return None


def event_key(
    message: Message, header: str, mode: MissingKeyMode, fingerprint: str
) -> EventKey | Reply | None:
    """The submission's key; None when the zone allows keyless mail; a Reply to refuse it."""
    values = message.get_all(header)
    if len(values) > 1:
        return replies.malformed_key(header, "the header appears more than once")
    if values:
        problem = key_problem(values[0])
        if problem:
            return replies.malformed_key(header, problem)
        return EventKey(values[0], derived=False)
    if mode == "reject":
        return replies.missing_key(header)
    if mode == "derive":
        return EventKey("auto:" + fingerprint, derived=True)
    return None


def message_id_for(zone: str, key: str, domain: str) -> str:
    """A Message-ID derived from zone + key, so a copy made anywhere is recognisable."""
    digest = hashlib.sha256(f"{zone}\x00{key}".encode()).hexdigest()[:32]
    return f"<sg.{digest}@{domain}>"


def qualified_key(zone: str, key: str) -> str:
    """The key as sent to a provider that dedupes on a header: unique across zones."""
    return f"{zone}:{key}"
