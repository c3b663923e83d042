"""VERP for mailed reports (DESIGN.md §18): the envelope sender that proves a DSN or ARF
report is about a message smtpguard sent.

Every message relayed for a zone leaves with the envelope sender `b+TOKEN@DOMAIN`, TOKEN =
the attempt's sg id, a dash, and a truncated HMAC-SHA256 of the id under the mailbox secret.
A report mailed to that address names the message by something only smtpguard could have
written: the Message-ID a report quotes is visible to every recipient (and smtpguard's own
default one is a hash of zone and key), so it proves nothing.

Pure: no I/O. The secret is bytes given by the caller; the address is compared without
regard to the case of its domain, and the token is lower-case hex, which survives an MTA
that folds the local part's case.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

PREFIX = "b+"
MAC_CHARS = 20
"""80 bits of the HMAC: a forger who cannot read the secret guesses one in 2**80."""
SG_ID_ROOM = 24
"""Room for an sg id (19 hex digits now: 11 of milliseconds, 8 random)."""
DOMAIN_MAX = 254 - len(PREFIX) - SG_ID_ROOM - 1 - MAC_CHARS - 1
"""The longest VERP domain whose `b+TOKEN@DOMAIN` fits RFC 5321's 256-octet path (<> included)."""
_CONTEXT = b"smtpguard-verp\x00"
"""Domain separation: the same secret used for something else never yields a token."""
_TOKEN = re.compile(r"^([0-9a-f]{1,64})-([0-9a-f]{" + str(MAC_CHARS) + "})$")


def mac(secret: bytes, sg_id: str) -> str:
    return hmac.new(secret, _CONTEXT + sg_id.encode("ascii"), hashlib.sha256).hexdigest()[:MAC_CHARS]


def sender(secret: bytes, sg_id: str, domain: str) -> str:
    """The envelope sender of the attempt `sg_id`."""
    return f"{PREFIX}{sg_id}-{mac(secret, sg_id)}@{domain}"


@dataclass(frozen=True, slots=True)
class Addressed:
    """What a report's RCPT TO says about it."""

    verp: bool
    """The address is at the VERP domain, in the `b+…` form (verified or not)."""
    sg_id: str | None = None
    """The attempt whose token verified; None when it did not (tampered, guessed, malformed)."""


def read_address(address: str, domain: str | None, secret: bytes | None) -> Addressed:
    """Whether `address` is a VERP address of `domain`, and the sg id its token proves."""
    if domain is None or secret is None:
        return Addressed(False)
    local, at, host = address.strip().strip("<>").rpartition("@")
    if not at or host.lower().rstrip(".") != domain.lower().rstrip("."):
        return Addressed(False)
    if not local.lower().startswith(PREFIX):
        return Addressed(False)
    m = _TOKEN.match(local[len(PREFIX) :].lower())
    if m is None:
        return Addressed(True)
    sg_id, given = m.group(1), m.group(2)
    if not hmac.compare_digest(mac(secret, sg_id), given):
        return Addressed(True)
    return Addressed(True, sg_id)
