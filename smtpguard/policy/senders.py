"""Addresses: syntax that smtpguard refuses, normalisation, and zone sender mapping."""

from __future__ import annotations

import re
from collections.abc import Iterable

_DOMAIN = re.compile(
    r"^(?=.{1,253}$)([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
)


def normalize_address(address: str) -> str:
    """Lower-case the domain (RFC 5321 §2.4: local parts may be case-sensitive, domains not)."""
    address = address.strip()
    if address.startswith("<") and address.endswith(">"):
        address = address[1:-1]
    local, at, domain = address.rpartition("@")
    if not at:
        return address
    return f"{local}@{domain.lower()}"


def address_problem(address: str) -> str | None:
    """Why an envelope address is refused, or None.

    Refuses the historic relay tricks an open-relay probe tries: percent hack, source
    routes, bang paths, quoted local parts hiding an @, several @, control characters.
    """
    if any(c in address for c in "\r\n\x00"):
        return "control characters in address"
    if not address:
        return "empty address"
    if address.startswith("@") or ":" in address:
        return "source routes are not accepted"
    if address.startswith('"') or '"' in address:
        return "quoted local parts are not accepted"
    if address.count("@") != 1:
        return "address must have exactly one @"
    local, _, domain = address.partition("@")
    if not local or len(local) > 64:
        return "bad local part"
    if "%" in local or "!" in local:
        return "percent hack and bang paths are not accepted"
    if any(c.isspace() or not c.isprintable() or c in "<>()[],;\\" for c in local):
        return "bad characters in local part"
    if not _DOMAIN.match(domain.lower()):
        return "bad domain"
    return None


def sender_allowed(address: str, aliases: Iterable[str]) -> bool:
    """True when `address` is one of the zone's aliases: an exact address or `@domain`."""
    addr = normalize_address(address).lower()
    local, at, domain = addr.rpartition("@")
    if not at or not local:
        return False
    for alias in aliases:
        alias = alias.lower()
        if alias.startswith("@"):
            if domain == alias[1:]:
                return True
        elif addr == alias:
            return True
    return False
