"""The business event key: taken from its header, validated, or derived (DESIGN.md §4)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
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
    message: Message, header: str | Sequence[str], mode: MissingKeyMode, fingerprint: str
) -> EventKey | Reply | None:
    """The submission's key; None when the zone allows keyless mail; a Reply to refuse it.

    `header` may name several headers (aliases, e.g. an app moving from an HTTP API that
    already sends `Idempotency-Key`): the first present in that order wins. Two of them
    present with different values cannot be one event and are refused; the same value is
    the same key said twice and is taken."""
    names = (header,) if isinstance(header, str) else tuple(header)
    found: list[tuple[str, str]] = []
    for name in names:
        values = message.get_all(name)
        if len(values) > 1:
            return replies.malformed_key(name, "the header appears more than once")
        if values:
            problem = key_problem(values[0])
            if problem:
                return replies.malformed_key(name, problem)
            found.append((name, values[0]))
    if found:
        first_name, first = found[0]
        for other_name, other in found[1:]:
            if other != first:
                return replies.malformed_key(
                    f"{first_name} and {other_name}", "the two headers carry different keys"
                )
        return EventKey(first, derived=False)
    if mode == "reject":
        return replies.missing_key(" or ".join(names))
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
