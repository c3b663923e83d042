"""Message classes (DESIGN.md §4a, §16): which class a message names, and whether queue mode
accepts it."""

from __future__ import annotations

from collections.abc import Collection

from smtpguard import replies
from smtpguard.policy.message import Message
from smtpguard.replies import Reply


def class_names(message: Message, class_header: str, zone_default: str | None, default: str) -> list[str]:
    """The classes the message's class header names (lower-cased, each value), or the
    zone's default class (else queue.default_class) when it has none: what queue mode
    validates and a class pause matches against."""
    values = message.get_all(class_header)
    if not values:
        return [zone_default or default]
    return [v.strip().lower() for v in values]


def message_class(
    message: Message, class_header: str, zone_default: str | None, default: str, classes: Collection[str]
) -> str | Reply:
    names = class_names(message, class_header, zone_default, default)
    name = names[0]
    if len(names) > 1 or name not in classes:
        return replies.malformed_message(f"{class_header} must be one of {', '.join(sorted(classes))}")
    return name
