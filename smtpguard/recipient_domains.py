"""RCPT's recipient-domain check (`recipient_domains: check`, DESIGN.md §3 and §12).

Looks the domain up through the resolver seam, asks policy/recipients.py, and keeps the
verdict for the answer's TTL, so a burst to one domain costs one lookup. Concurrent RCPTs
for a domain not yet known share one lookup. Nothing here touches the store: a refusal at
RCPT reserves nothing and spends no cap unit.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from smtpguard import replies
from smtpguard.policy import recipients
from smtpguard.policy.recipients import TROUBLE_TTL, DomainVerdict
from smtpguard.readiness.dns import DnsClient
from smtpguard.replies import Reply

MAX_ENTRIES = 10_000
"""Domains kept at once; the oldest go first. Bounded so that RCPTs to random domains
cannot grow memory without limit."""


class RecipientDomains:
    def __init__(self, dns: DnsClient, clock: Callable[[], float] = time.monotonic) -> None:
        self.dns = dns
        self.clock = clock
        self._known: OrderedDict[str, tuple[DomainVerdict, float]] = OrderedDict()
        self._asking: dict[str, asyncio.Task[DomainVerdict]] = {}
        """The lookup under way per domain; the dict holds the task's only strong reference."""
        self.lookups = 0
        """Domains looked up (not served from the cache): for tests and the bench."""

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
        now = self.clock()
        known = self._known.get(domain)
        if known is not None and known[1] > now:
            return known[0]
        pending = self._asking.get(domain)
        if pending is None:
            # The lookup is the shared task's, not the first caller's: a client that hangs
            # up (aiosmtpd cancels its session) cancels only its own wait, through the
            # shield, never the lookup the other sessions for this domain are waiting on.
            pending = asyncio.get_running_loop().create_task(self._settle(domain))
            # Retrieved even when every waiter went away, so a failure is never "unretrieved".
            pending.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._asking[domain] = pending
        return await asyncio.shield(pending)

    async def _settle(self, domain: str) -> DomainVerdict:
        try:
            verdict = await self._bounded_look_up(domain)
        finally:
            del self._asking[domain]
        self._known[domain] = (verdict, self.clock() + verdict.ttl)
        self._known.move_to_end(domain)
        while len(self._known) > MAX_ENTRIES:
            self._known.popitem(last=False)
        return verdict

    async def _bounded_look_up(self, domain: str) -> DomainVerdict:
        """One deadline, `dns.timeout`, for the whole verdict (MX, then A/AAAA): a RCPT
        never waits longer than that; past it the recipient is accepted."""
        self.lookups += 1
        try:
            async with asyncio.timeout(self.dns.timeout):
                return await self._look_up(domain)
        except TimeoutError:
            return DomainVerdict("accept", TROUBLE_TTL, "lookup timed out")

    async def _look_up(self, domain: str) -> DomainVerdict:
        mx = await self.dns.lookup("MX", domain)
        if not recipients.needs_address_lookup(mx):
            return recipients.judge(mx)
        a, aaaa = await asyncio.gather(self.dns.lookup("A", domain), self.dns.lookup("AAAA", domain))
        return recipients.judge(mx, a, aaaa)
