"""A provider event's name and the Kind it has (policy/events.py), read through the provider's
table: a name maps to a Kind, or to what decides the Kind from the rest of the event."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from smtpguard.events.sources.base import _str
from smtpguard.policy.events import Kind, Malformed

Kinds = Mapping[str, Kind | Callable[[dict[str, Any]], Kind]]
"""A provider's event name → its Kind; a name the table does not hold is Kind.OTHER."""


def event_kind(event: dict[str, Any], field: str, kinds: Kinds, missing: str) -> tuple[str, Kind]:
    """The event's name (its `field`; Malformed(`missing`) without one) and its Kind."""
    name = _str(event.get(field))
    if name is None:
        raise Malformed(missing)
    kind = kinds.get(name, Kind.OTHER)
    return name, kind if isinstance(kind, Kind) else kind(event)
