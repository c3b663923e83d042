"""`smtpguard doctor` (DESIGN.md §12): could every provider of the route deliver for every
sender domain — SPF, DKIM, DMARC, MX — and does each provider answer its probe?

This module only gathers: it asks the resolver and the providers, concurrently, and hands
the answers to policy/readiness.py and policy/spf.py, which decide. Nothing is sent: the
probe stops before MAIL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from smtpguard.config import Config, ConfigError, SmtpProviderConfig, read_secret
from smtpguard.policy import readiness as verdicts
from smtpguard.policy import spf
from smtpguard.policy.dnsdata import Lookup
from smtpguard.policy.readiness import Finding, ProbeResult
from smtpguard.readiness.dns import DnsClient
from smtpguard.readiness.probe import probe
from smtpguard.readiness.store import store_findings

_MAX_SPF_ROUNDS = 12
"""More rounds than the 10-term limit can need: each round follows at least one term."""


@dataclass
class Lookups:
    """One doctor run's answers: each (type, name) asked once, however many zones and
    providers read it."""

    dns: DnsClient
    known: dict[tuple[str, str], Lookup] = field(default_factory=dict)

    async def fetch(self, queries: Iterable[tuple[str, str]]) -> None:
        todo = [q for q in set(queries) if q not in self.known]
        answers = await asyncio.gather(*(self.dns.lookup(t, n) for t, n in todo))
        self.known.update(zip(todo, answers, strict=True))

    async def get(self, rdtype: str, name: str) -> Lookup:
        await self.fetch([(rdtype, name)])
        return self.known[(rdtype, name)]

    async def spf_tree(self, domain: str) -> spf.SpfTree:
        for _ in range(_MAX_SPF_ROUNDS):
            result = spf.walk(domain, self.known)
            if isinstance(result, spf.SpfTree):
                return result
            await self.fetch(result.queries)
        raise AssertionError("the SPF walk did not end within its lookup limit")


async def check_domain(
    lookups: Lookups, config: Config, zone: str, domain: str, providers: list[SmtpProviderConfig]
) -> list[Finding]:
    out: list[Finding] = []
    for p in providers:
        # A provider that sends with its own return-path subdomain (`send.DOMAIN`) is
        # authorised by that subdomain's SPF record, not the sender domain's.
        spf_domain = f"{p.spf_subdomain}.{domain}" if p.spf_subdomain else domain
        status, detail = verdicts.judge_spf(await lookups.spf_tree(spf_domain), p.spf)
        if spf_domain != domain:
            detail = f"SPF of {spf_domain}: {detail}"
        out.append(Finding("spf", zone, domain, p.name, status, detail))
    for p in providers:
        answers = [(sel, await lookups.get("TXT", f"{sel}._domainkey.{domain}")) for sel in p.dkim_selectors]
        status, detail = verdicts.judge_dkim(answers)
        out.append(Finding("dkim", zone, domain, p.name, status, detail))
    own = await lookups.get("TXT", f"_dmarc.{domain}")
    inherited = None
    org = organisational_domain(domain)
    if org != domain and verdicts.dmarc_record(own) is None:
        inherited = (org, await lookups.get("TXT", f"_dmarc.{org}"))
    status, detail = verdicts.judge_dmarc(own, inherited)
    out.append(Finding("dmarc", zone, domain, None, status, detail))
    mx = await lookups.get("MX", domain)
    a = aaaa = None
    if mx.status == "nodata":
        await lookups.fetch([("A", domain), ("AAAA", domain)])
        a, aaaa = lookups.known[("A", domain)], lookups.known[("AAAA", domain)]
    status, detail = verdicts.judge_mx(mx, config.zones[zone].mx, a, aaaa)
    out.append(Finding("mx", zone, domain, None, status, detail))
    return out


async def check_verp_domain(
    lookups: Lookups, domain: str, providers: list[SmtpProviderConfig]
) -> list[Finding]:
    """The VERP domain of `events.mailbox` (DESIGN.md §18): mail sent with `b+TOKEN@DOMAIN`
    needs that domain's SPF to authorise each provider (where the provider keeps the
    envelope sender), and an MX that takes the reports back."""
    out: list[Finding] = []
    for p in providers:
        status, detail = verdicts.judge_spf(await lookups.spf_tree(domain), p.spf)
        out.append(Finding("spf", None, domain, p.name, status, f"VERP domain: {detail}"))
    mx = await lookups.get("MX", domain)
    a = aaaa = None
    if mx.status == "nodata":
        await lookups.fetch([("A", domain), ("AAAA", domain)])
        a, aaaa = lookups.known[("A", domain)], lookups.known[("AAAA", domain)]
    status, detail = verdicts.judge_mx(mx, None, a, aaaa)
    out.append(Finding("mx", None, domain, None, status, f"VERP domain: {detail}"))
    return out


def organisational_domain(domain: str) -> str:
    """The last two labels: RFC 7489's organisational domain without the public suffix
    list, right for `notify.acme.example`, too short for `shop.example.co.uk` (whose own
    _dmarc record, when it has one, is read first anyway)."""
    labels = domain.split(".")
    return ".".join(labels[-2:]) if len(labels) > 2 else domain


async def probe_findings(config: Config, helo: str, now: Callable[[], float]) -> list[Finding]:
    async def one(index: int) -> Finding:
        cfg = config.providers[index]
        try:
            password = (
                read_secret(cfg.password_env, cfg.password_file, f"providers[{index}]")
                if isinstance(cfg, SmtpProviderConfig)
                else None
            )
        except ConfigError as e:
            result = ProbeResult(False, f"AUTH: {'; '.join(e.problems)}")
        else:
            result = await probe(cfg, password, helo)
        status, detail = verdicts.judge_probe(result, now())
        return Finding("probe", None, None, cfg.name, status, detail)

    return list(await asyncio.gather(*(one(i) for i in range(len(config.providers)))))


async def run(
    config: Config,
    zone: str | None = None,
    probes: bool = True,
    helo: str = "localhost",
    now: Callable[[], float] | None = None,
) -> list[Finding]:
    clock = now or time.time
    lookups = Lookups(DnsClient(config.dns))
    # A Maildir provider sends nothing to the Internet: no SPF or DKIM to publish for it.
    senders = [p for p in config.providers if isinstance(p, SmtpProviderConfig)]
    zones = [zone] if zone is not None else list(config.zones)
    jobs = [
        check_domain(lookups, config, z, domain, senders)
        for z in zones
        for domain in verdicts.sender_domains(config.zones[z].senders)
    ]
    mailbox = config.events.mailbox if config.events is not None else None
    if mailbox is not None and mailbox.domain is not None:
        jobs.append(check_verp_domain(lookups, mailbox.domain.rstrip("."), senders))
    findings: list[Finding] = []
    for part in await asyncio.gather(*jobs):
        findings.extend(part)
    if probes:
        findings.extend(await probe_findings(config, helo, clock))
    findings.extend(await store_findings(config))
    return findings


def render_table(findings: list[Finding]) -> str:
    rows = [("check", "zone", "domain", "provider", "status", "detail")]
    rows += [
        (f.check, f.zone or "-", f.domain or "-", f.provider or "-", f.status, f.detail) for f in findings
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5] for r in rows]
    errors = sum(f.status == "error" for f in findings)
    warnings = sum(f.status == "warning" for f in findings)
    lines.append(f"{len(findings)} checks: {errors} error(s), {warnings} warning(s)")
    return "\n".join(lines)
