"""What one DNS lookup came back with, as plain data: the seam between the resolver
adapter (smtpguard/readiness/dns.py) and the pure checks that read its answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "nxdomain", "nodata", "error"]


@dataclass(frozen=True, slots=True)
class Lookup:
    status: Status
    records: tuple[str, ...] = ()
    """TXT: each record's strings joined (RFC 7208 §3.3); MX: "PREFERENCE EXCHANGE", the
    exchange without its trailing dot ("." stays "." — a null MX); A/AAAA: the address."""
    ttl: float = 0.0
    """How long the answer may be kept: the records' TTL, or for a negative answer the
    zone's negative-caching TTL (RFC 2308); 0 when unknown."""
    detail: str = ""
    """For `error`: what went wrong (SERVFAIL, timeout), fit for an operator."""

    @property
    def void(self) -> bool:
        """RFC 7208 §4.6.4: a lookup that returned no records (NXDOMAIN or an empty answer)."""
        return self.status in ("nxdomain", "nodata")


@dataclass(frozen=True, slots=True)
class MxRecord:
    preference: int
    exchange: str


def mx_records(lookup: Lookup) -> list[MxRecord]:
    out = []
    for text in lookup.records:
        pref, _, exchange = text.partition(" ")
        out.append(MxRecord(int(pref), exchange.lower()))
    return out


def is_null_mx(records: list[MxRecord]) -> bool:
    """RFC 7505 §3: one MX record, preference 0, exchange the root: the domain accepts no
    mail. A "." among other MX records is a misconfiguration the other hosts still serve."""
    return len(records) == 1 and records[0].exchange == "." and records[0].preference == 0
