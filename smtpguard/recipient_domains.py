"""RCPT's recipient-domain check (`recipient_domains: check`, DESIGN.md §3 and §12).

Looks the domain up through the resolver seam, asks policy/recipients.py, and keeps the
verdict for the answer's TTL (readiness/cache.py: a burst to one domain costs one lookup,
concurrent RCPTs for a domain not yet known share one). Nothing here touches the store: a refusal at
RCPT reserves nothing and spends no cap unit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from smtpguard import replies
from smtpguard.policy import recipients
from smtpguard.policy.recipients import TROUBLE_TTL, DomainVerdict
from smtpguard.readiness.cache import SharedLookups
from smtpguard.readiness.dns import DnsClient
from smtpguard.replies import Reply


class RecipientDomains:
    def __init__(self, dns: DnsClient, clock: Callable[[], float] = time.monotonic) -> None:
        self.dns = dns
        self._verdicts = SharedLookups(self._bounded_look_up, clock)

    @property
    def lookups(self) -> int:
        """Domains looked up (not served from the cache): for tests and the bench."""
        return self._verdicts.lookups

    async def refusal(self, address: str) -> Reply | None:
        """The §3 reply for a recipient whose domain cannot receive mail, else None."""
        domain = address.rpartition("@")[2].lower().rstrip(".")
        if not domain or domain.startswith("["):
            return None  # an address literal names a host, not a domain with MX records
        verdict = await self.verdict(domain)
        if verdict.verdict == "null_mx":
            return replies.recipient_null_mx(domain)
        if verdict.verdict in ("no_domain", "no_mail"):
            return replies.recipient_domain_unroutable(domain, verdict.detail)
        return None

    async def verdict(self, domain: str) -> DomainVerdict:
        return await self._verdicts.get(domain)

    async def _bounded_look_up(self, domain: str) -> tuple[DomainVerdict, float]:
        """One deadline, `dns.timeout`, for the whole verdict (MX, then A/AAAA): a RCPT
        never waits longer than that; past it the recipient is accepted."""
        try:
            async with asyncio.timeout(self.dns.timeout):
                verdict = await self._look_up(domain)
        except TimeoutError:
            verdict = DomainVerdict("accept", TROUBLE_TTL, "lookup timed out")
        return verdict, verdict.ttl

    async def _look_up(self, domain: str) -> DomainVerdict:
        mx = await self.dns.lookup("MX", domain)
        if not recipients.needs_address_lookup(mx):
            return recipients.judge(mx)
        a, aaaa = await asyncio.gather(self.dns.lookup("A", domain), self.dns.lookup("AAAA", domain))
        return recipients.judge(mx, a, aaaa)
