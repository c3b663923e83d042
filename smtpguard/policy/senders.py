"""Addresses: syntax that smtpguard refuses, normalisation, and zone sender mapping."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from smtpguard import replies
from smtpguard.replies import Reply

_DOMAIN = re.compile(
    r"^(?=.{1,253}$)([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
)


def normalize_address(address: str) -> str:
    """Lower-case the domain (RFC 5321 §2.4: local parts may be case-sensitive, domains not)."""
    address = address.strip()
    # Until nothing is left to take off, so that normalising twice changes nothing.
    while address.startswith("<") and address.endswith(">"):
        address = address[1:-1].strip()
    local, at, domain = address.rpartition("@")
    if not at:
        return address
    return f"{local}@{domain.lower()}"


_LOCAL_SPECIALS = re.compile(r"[\s<>()\[\],;\\]")


@functools.lru_cache(maxsize=4096)
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
    if not local.isprintable() or _LOCAL_SPECIALS.search(local):
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


# One mailbox, in the shapes submission clients actually write (RFC 5322 §3.4):
#   addr@dom   |   addr@dom (comment)   |   [display name] <addr@dom> [(comment)]
# A display name is quoted strings and atoms (encoded-words included) without specials, so
# `billing@acme.example <evil@attacker.example>`, `<a@x> <b@y>`, groups and address lists
# do not match: a mail reader might show, or a DMARC check use, a different address than
# the one judged here.
_ATOM = r"[^\s\x00-\x1f\x7f<>@,;:\"()\[\]\\]+"
_QUOTED = r'"(?:[^"\\\x00-\x1f\x7f]|\\[^\x00-\x1f\x7f])*"'
_WORD = rf"(?:{_ATOM}|{_QUOTED})"
_COMMENT = r"(?:\s*\([^()\\<>@\x00-\x1f\x7f]*\))?"
_MAILBOX = re.compile(
    rf"(?:(?P<bare>{_ATOM}@{_ATOM})"
    rf"|(?:{_WORD}(?:\s+{_WORD})*)?\s*<(?P<angle>[^<>\s]+)>){_COMMENT}"
)


def header_from_address(value: str) -> str | None:
    """The single mailbox address a From: header value names, or None when it names none,
    several, or hides one behind syntax that readers interpret differently."""
    m = _MAILBOX.fullmatch(value.strip())
    if m is None:
        return None
    address = m.group("bare") or m.group("angle")
    return None if address_problem(address) else address


@dataclass(frozen=True, slots=True)
class FromRefused:
    reply: Reply
    decision: str
    """`rejected:from` (a valid address not mapped to the zone) or `rejected:malformed`."""


def check_header_from(values: list[str], zone: str, aliases: Iterable[str]) -> FromRefused | None:
    """DESIGN.md §3: the header From must be one mapped alias of the zone (never rewritten).

    Judged on the address itself, never on a display name or an encoded-word that decodes
    to a mapped alias."""
    if not values:
        return _malformed_from("message has no From: header")
    if len(values) > 1:
        return _malformed_from("message has more than one From: header")
    address = header_from_address(values[0])
    if address is None:
        return _malformed_from("From: header must name exactly one valid mailbox")
    if not sender_allowed(address, aliases):
        return FromRefused(replies.from_not_allowed(address, zone), "rejected:from")
    return None


def _malformed_from(problem: str) -> FromRefused:
    return FromRefused(replies.malformed_message(problem), "rejected:malformed")
