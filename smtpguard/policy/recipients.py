"""Can a recipient's domain receive mail at all? (DESIGN.md §3, §12 `recipient_domains`)

Pure: the MX answer, and when there is no MX the A/AAAA answers (RFC 5321 §5.1's implicit
MX), become a verdict and how long it may be kept. DNS trouble (SERVFAIL, timeout) always
accepts: a resolver outage must never stop mail that a real MTA would deliver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from smtpguard.policy.dnsdata import Lookup, is_null_mx, mx_records

TROUBLE_TTL = 30.0
"""How long a failed lookup's "accept" is kept: long enough that a dead resolver does not
add its timeout to every RCPT, short enough that the check is back soon after it is."""
MIN_TTL = 1.0
MAX_TTL = 3600.0
"""A record's TTL, clamped: a 0 TTL would make every RCPT query; a week-long one would keep
a fixed domain refused long after it was fixed."""

Verdict = Literal["accept", "null_mx", "no_domain", "no_mail"]


@dataclass(frozen=True, slots=True)
class DomainVerdict:
    verdict: Verdict
    ttl: float
    detail: str = ""


def needs_address_lookup(mx: Lookup) -> bool:
    """No MX records (and no error): the domain's A/AAAA decide (implicit MX)."""
    return mx.status == "nodata"


def judge(mx: Lookup, a: Lookup | None = None, aaaa: Lookup | None = None) -> DomainVerdict:
    if mx.status == "error":
        return DomainVerdict("accept", TROUBLE_TTL, f"MX lookup failed: {mx.detail}")
    if mx.status == "nxdomain":
        return DomainVerdict("no_domain", _clamp(mx.ttl), "domain does not exist")
    if mx.status == "ok":
        if is_null_mx(mx_records(mx)):
            return DomainVerdict("null_mx", _clamp(mx.ttl), "null MX")
        return DomainVerdict("accept", _clamp(mx.ttl))
    if a is None or aaaa is None:
        raise ValueError("no MX: the A and AAAA answers are needed")
    if a.status == "ok" or aaaa.status == "ok":
        return DomainVerdict("accept", _clamp(min(x.ttl for x in (mx, a, aaaa) if x.status != "error")))
    if a.status == "error" or aaaa.status == "error":
        return DomainVerdict("accept", TROUBLE_TTL, "address lookup failed")
    return DomainVerdict("no_mail", _clamp(min(mx.ttl, a.ttl, aaaa.ttl)), "no MX and no A/AAAA")


def _clamp(ttl: float) -> float:
    return min(max(ttl, MIN_TTL), MAX_TTL)
