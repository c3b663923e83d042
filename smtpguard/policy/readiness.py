"""Doctor's verdicts (DESIGN.md §12): fetched DNS answers and probe results → findings.

Pure, one function per check as checkdmarc structures its records: each returns a status
and a line for the operator, never prints, never queries. The statuses and their rows are
§12's table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from smtpguard.policy.dnsdata import Lookup, is_null_mx, mx_records
from smtpguard.policy.spf import SpfTree, normalise

Status = Literal["ok", "warning", "error"]
CheckName = Literal["spf", "dkim", "dmarc", "mx", "probe", "store"]
CERT_WARNING_DAYS = 14
_RANK = {"ok": 0, "warning": 1, "error": 2}


@dataclass(frozen=True, slots=True)
class Finding:
    check: CheckName
    zone: str | None
    domain: str | None
    provider: str | None
    status: Status
    detail: str

    def to_dict(self) -> dict[str, str | None]:
        return {
            "check": self.check,
            "zone": self.zone,
            "domain": self.domain,
            "provider": self.provider,
            "status": self.status,
            "detail": self.detail,
        }


def worst(statuses: Sequence[Status]) -> Status:
    return max(statuses, key=_RANK.__getitem__, default="ok")


def sender_domains(senders: Sequence[str]) -> list[str]:
    """The domains of a zone's sender aliases (`billing@acme.example`, `@notify.acme.example`),
    in order, each once."""
    out: list[str] = []
    for alias in senders:
        domain = alias.rpartition("@")[2].lower().rstrip(".")
        if domain and domain not in out:
            out.append(domain)
    return out


def judge_spf(tree: SpfTree, provider_spf: str | None) -> tuple[Status, str]:
    if tree.errors:
        return "error", "; ".join(tree.errors)
    counts = f"{tree.terms} querying terms, {tree.voids} void lookups"
    if provider_spf is not None and normalise(provider_spf) not in tree.mechanisms:
        return "error", f"{provider_spf} is not reached through the SPF include tree ({counts})"
    warnings = list(tree.warnings)
    if tree.all_qualifier in ("+", "?"):
        word = "+all (any host may send as the domain)" if tree.all_qualifier == "+" else "?all (neutral)"
        warnings.insert(0, f"the record ends in {word}; use ~all or -all")
    if provider_spf is None:
        warnings.append("no spf configured for the provider, so its mechanism is not looked for")
    if warnings:
        return "warning", f"{'; '.join(warnings)} ({counts})"
    return "ok", f"{provider_spf} reached ({counts})"


def dkim_key(lookup: Lookup) -> tuple[bool, str]:
    """Whether a selector's TXT answer publishes a key: a DKIM record (RFC 6376 §3.6.1)
    whose p= tag is not empty (an empty p= is a revoked key)."""
    if lookup.status == "error":
        return False, f"lookup failed ({lookup.detail})"
    if lookup.void:
        return False, "no record"
    for record in lookup.records:
        tags = _tags(record)
        if "p" in tags or tags.get("v", "").upper() == "DKIM1":
            if tags.get("p"):
                return True, f"key published ({tags.get('k', 'rsa')})"
            return False, "p= is empty (the key is revoked)"
    return False, "no DKIM record (no p= tag)"


def judge_dkim(selectors: Sequence[tuple[str, Lookup]]) -> tuple[Status, str]:
    """`selectors`: each configured selector with the TXT answer of SELECTOR._domainkey.DOMAIN."""
    if not selectors:
        return "warning", "no dkim_selectors configured for the provider"
    missing: list[str] = []
    present: list[str] = []
    for selector, lookup in selectors:
        ok, why = dkim_key(lookup)
        (present if ok else missing).append(f"{selector}: {why}")
    if missing:
        return "error", "; ".join(missing)
    return "ok", "; ".join(present)


def dmarc_records(lookup: Lookup) -> list[dict[str, str]]:
    """The `v=DMARC1` records of a _dmarc TXT answer, as tags."""
    return [tags for tags in map(_tags, lookup.records) if tags.get("v", "").upper() == "DMARC1"]


def dmarc_record(lookup: Lookup) -> dict[str, str] | None:
    found = dmarc_records(lookup)
    return found[0] if found else None


def judge_dmarc(own: Lookup, inherited: tuple[str, Lookup] | None) -> tuple[Status, str]:
    """`own`: the TXT answer of _dmarc.DOMAIN; `inherited`: (organisational domain, its
    _dmarc answer) when the domain is a subdomain (RFC 7489 §6.6.3 falls back to it)."""
    found = dmarc_records(own)
    where = "_dmarc record"
    if not found and inherited is not None:
        found = dmarc_records(inherited[1])
        where = f"_dmarc record of {inherited[0]}"
        if len(found) == 1 and found[0].get("sp"):
            found = [{**found[0], "p": found[0]["sp"]}]
    if len(found) > 1:
        # RFC 7489 §6.6.3: with more than one record, receivers apply no DMARC policy.
        return "error", f"more than one {where} ({len(found)}): receivers apply no policy; keep one"
    if not found:
        failed = own.status == "error" or (inherited is not None and inherited[1].status == "error")
        why = "could not be looked up" if failed else "no _dmarc record"
        return "warning", f"{why}: receivers apply no policy to mail that fails SPF and DKIM"
    policy = found[0].get("p", "").lower()
    if not policy:
        return "warning", f"{where} has no p= tag: receivers treat it as p=none or ignore it"
    if policy == "none":
        return "warning", f"{where} has p=none: monitoring only, nothing is enforced"
    return "ok", f"{where} has p={policy}"


def judge_mx(
    lookup: Lookup, expected: Sequence[str] | None, a: Lookup | None = None, aaaa: Lookup | None = None
) -> tuple[Status, str]:
    """`a`, `aaaa`: the sender domain's address answers, needed when it has no MX."""
    if lookup.status == "error":
        return "error", f"MX lookup failed ({lookup.detail})"
    if lookup.status == "nxdomain":
        return "error", "the sender domain does not exist (NXDOMAIN): bounces and replies cannot be delivered"
    if lookup.void:
        if a is None or aaaa is None:
            raise ValueError("no MX: the A and AAAA answers are needed")
        if a.status == "ok" or aaaa.status == "ok":
            return "ok", "no MX records (bounces go to the domain's A/AAAA)"
        if a.status == "error" or aaaa.status == "error":
            return "error", f"no MX records, and the A/AAAA lookup failed ({a.detail or aaaa.detail})"
        return "error", "no MX and no A/AAAA: bounces and replies to this sender domain cannot be delivered"
    records = mx_records(lookup)
    if is_null_mx(records):
        return "error", "null MX (RFC 7505): bounces and replies to this sender domain cannot be delivered"
    hosts = sorted({r.exchange for r in records if r.exchange != "."})
    if len(hosts) < len({r.exchange for r in records}):
        return (
            "warning",
            f'a null MX (".") among other MX records (RFC 7505 §3): remove it; MX {", ".join(hosts)}',
        )
    if expected is not None:
        leftover = [h for h in hosts if h not in expected]
        if leftover:
            return "warning", f"leftover MX: {', '.join(leftover)} not in the zone's mx list"
    return "ok", f"MX {', '.join(hosts)}"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    detail: str
    """On failure, the step and the reply it got (`AUTH: 535 5.7.8 …`); else what was done."""
    cert_not_after: float | None = None
    """The provider's certificate's expiry (epoch seconds), when TLS was negotiated."""
    cert_expired: bool = False


def judge_probe(result: ProbeResult, now: float) -> tuple[Status, str]:
    if result.cert_expired:
        return "error", result.detail
    if not result.ok:
        return "error", result.detail
    if result.cert_not_after is not None:
        left = result.cert_not_after - now
        if left < CERT_WARNING_DAYS * 86400:
            return "warning", f"{result.detail}; the certificate expires in {max(left, 0) / 86400:.1f} days"
    return "ok", result.detail


def _tags(record: str) -> dict[str, str]:
    """`v=DKIM1; k=rsa; p=MIIB…` → {"v": "DKIM1", "k": "rsa", "p": "MIIB…"} (RFC 6376 §3.2;
    whitespace inside values, as long keys are split, is dropped)."""
    out: dict[str, str] = {}
    for part in record.split(";"):
        name, sep, value = part.partition("=")
        if sep:
            out[name.strip().lower()] = "".join(value.split())
    return out
