"""Addresses: syntax that smtpguard refuses, normalisation, and zone sender mapping.

Case is folded for ASCII only wherever an address is judged or compared: Unicode case
mapping turns U+212A KELVIN SIGN into "k", so `x@ban\u212a.example` lowered would pass as
`x@bank.example`. Non-ASCII characters are compared exactly (sender mapping: a refusal is
the safe side) or case-folded deliberately (suppression: a match is the safe side).
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from smtpguard import replies
from smtpguard.policy.decisions import Decision
from smtpguard.replies import Reply

_DOMAIN = re.compile(
    r"^(?=.{1,253}$)([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
)
_LDH_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_U_LABEL_CATEGORIES = frozenset({"Ll", "Lo", "Lm", "Mn", "Mc", "Nd"})
"""IDNA 2008's LetterDigits (RFC 5892 §2.1) less Lu: it disallows what case mapping changes."""


def ascii_lower(text: str) -> str:
    """A-Z to a-z and nothing else (RFC 5321 §2.4: domains compare case-insensitively in
    ASCII); str.lower() would also map non-ASCII characters, some onto ASCII ones."""
    return text.lower() if text.isascii() else text.translate(_ASCII_LOWER)


def normalize_address(address: str) -> str:
    """Strip brackets and lower-case the domain's ASCII letters; the local part is kept as
    written (RFC 5321 §2.4: local parts may be case-sensitive, domains not). This is the
    envelope address as relayed and fingerprinted; suppression compares suppression_key."""
    address = address.strip()
    # Until nothing is left to take off, so that normalising twice changes nothing.
    while address.startswith("<") and address.endswith(">"):
        address = address[1:-1].strip()
    local, at, domain = address.rpartition("@")
    if not at:
        return address
    return f"{local}@{ascii_lower(domain)}"


def suppression_key(address: str) -> str:
    """The form in which suppression entries and recipients are compared.

    RFC 5321 lets a receiving system treat local parts case-sensitively, but every major
    provider folds them, and a suppression list exists so that nobody who bounced or
    complained is mailed again: `Bob@x` suppressed must stop `bob@x`. So the whole address
    is case-folded (Unicode default caseless matching, NFC) for this comparison only; an
    over-match refuses a message, a miss mails someone who asked not to be. The address on
    the wire is never rewritten."""
    address = normalize_address(address)
    if address.isascii():
        return address.lower()  # the same result, without the Unicode tables
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", address).casefold())


def needs_smtputf8(address: str) -> bool:
    """RFC 6531: an address with any non-ASCII character can only travel with SMTPUTF8."""
    return not address.isascii()


def route_offers_smtputf8(offers: Iterable[bool | None]) -> bool | None:
    """Whether the provider route can relay SMTPUTF8, from each provider's last EHLO (None:
    not connected yet). One provider that offers it is enough (the relay fails over to it);
    only a route where every provider is known not to offer it refuses."""
    known = list(offers)
    if any(o is True for o in known):
        return True
    if any(o is None for o in known):
        return None
    return False


def smtputf8_refusal(
    address: str,
    what: Literal["sender", "recipient"],
    declared: bool,
    route_offers: bool | None,
) -> Reply | None:
    """DESIGN.md §3: a non-ASCII address without SMTPUTF8 on MAIL, or with SMTPUTF8 declared
    for a route whose providers do not offer it → 553 5.6.7 (RFC 6531), at MAIL for the
    sender and at RCPT for each recipient. An ASCII address is never refused here (the relay
    drops a declaration the message does not need). An unknown route accepts: the relay
    checks before DATA."""
    if not needs_smtputf8(address):
        return None  # an ASCII address travels with or without SMTPUTF8
    if not declared:
        return replies.non_ascii_address(what, address, "MAIL FROM did not declare SMTPUTF8")
    if route_offers is False:
        return replies.non_ascii_address(what, address, "the upstream route does not offer SMTPUTF8")
    return None


def _domain_problem(domain: str) -> str | None:
    if domain.isascii():
        return None if _DOMAIN.match(ascii_lower(domain)) else "bad domain"
    # A U-label domain (RFC 5890): relayed only with SMTPUTF8, which the listener checks.
    length = -1
    for label in ascii_lower(domain).split("."):
        if label.isascii():
            if not _LDH_LABEL.match(label):
                return "bad domain"
            length += len(label) + 1
        else:
            a_label = _a_label_length(label)
            if a_label is None:
                return "bad domain"
            length += a_label + 1
    return None if length <= 253 else "bad domain"


def _a_label_length(label: str) -> int | None:
    """The length of a U-label's A-label (xn--…), or None when the label is not one IDNA
    2008 registers: letters, digits, marks (not first) and inner hyphens, unchanged by case
    mapping and NFKC (so also NFC). A KELVIN SIGN, a fullwidth letter or a ligature that
    stands for ASCII is refused, never mapped onto what it looks like. Stricter than IDNA
    2008 for its few contextual characters (ZWJ, ZWNJ, middle dot)."""
    if (
        unicodedata.normalize("NFKC", label.lower()) != label
        or label.startswith("-")
        or label.endswith("-")
        or unicodedata.category(label[0]) in ("Mn", "Mc")
        or not all(c == "-" or unicodedata.category(c) in _U_LABEL_CATEGORIES for c in label)
    ):
        return None
    length = len("xn--") + len(label.encode("punycode"))
    return length if length <= 63 else None


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
    return _domain_problem(domain)


def sender_allowed(address: str, aliases: Iterable[str]) -> bool:
    """True when `address` is one of the zone's aliases: an exact address or `@domain`.

    Case-insensitive in ASCII only: a non-ASCII character matches only itself, so no
    Unicode case mapping can turn an address into a mapped alias."""
    addr = ascii_lower(normalize_address(address))
    local, at, domain = addr.rpartition("@")
    if not at or not local:
        return False
    for alias in aliases:
        alias = ascii_lower(alias)
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
    decision: Decision
    """FROM (a valid address not mapped to the zone) or MALFORMED."""


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
        return FromRefused(replies.from_not_allowed(address, zone), Decision.FROM)
    return None


def _malformed_from(problem: str) -> FromRefused:
    return FromRefused(replies.malformed_message(problem), Decision.MALFORMED)


def recipient_tag(address: str) -> str:
    """A short, stable hash of a recipient as suppression compares it: enough to tell
    whether an address was one of a record's recipients, not enough to list them."""
    return hashlib.sha256(suppression_key(address).encode("utf-8", "surrogatepass")).hexdigest()[:16]
