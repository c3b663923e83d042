"""A recipient's receiving provider, from its domain's MX hosts (DESIGN.md §21).

The MX query goes through the resolver every lookup uses (readiness/dns.py, `dns:`), and the
answer is kept for its TTL (readiness/cache.py). One deadline, `dns.timeout`, bounds the
lookup: past it, or on any DNS error, the MX hosts an earlier lookup found for the domain
stand in (expired, for TROUBLE_TTL), so an outage does not release a paused receiver's mail;
a domain never looked up is `other` for that message — receiver shaping never holds mail up
on DNS trouble alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

from smtpguard.policy import receivers
from smtpguard.policy.receivers import OTHER, TROUBLE_TTL
from smtpguard.readiness.cache import SharedLookups
from smtpguard.readiness.dns import DnsClient


class ReceiverLookup:
    def __init__(
        self,
        dns: DnsClient,
        table: Mapping[str, Sequence[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dns = dns
        self.table: Mapping[str, Sequence[str]] = dict(table)
        self._hosts = SharedLookups(self._bounded_mx, clock)
        self.troubles = 0
        """Lookups that timed out or failed (counted `other`): for tests and the log."""

    @property
    def lookups(self) -> int:
        return self._hosts.lookups

    async def receiver(self, address: str) -> str:
        """The receiver the recipient is counted under (`other` on DNS trouble)."""
        return await self.shaped(address) or OTHER

    async def shaped(self, address: str) -> str | None:
        """The receiver whose shaping holds the recipient; None on DNS trouble."""
        domain = receivers.domain_of(address)
        if domain is None:
            return OTHER
        return receivers.shaped_receiver(await self._hosts.get(domain), self.table)

    async def shaped_all(self, addresses: Sequence[str]) -> list[str | None]:
        """shaped() of each address, their domains looked up together: a recipient list of
        many domains waits one dns.timeout at most, not one per domain."""
        for address in addresses:
            self.start(address)
        return [await self.shaped(a) for a in addresses]

    def start(self, address: str) -> None:
        """Begin the recipient's lookup without waiting for it (receiver() joins it)."""
        domain = receivers.domain_of(address)
        if domain is not None:
            self._hosts.start(domain)

    def cached(self, address: str) -> str | None:
        """The receiver from the cache alone, or None when it would need a lookup."""
        domain = receivers.domain_of(address)
        if domain is None:
            return OTHER
        hosts = self._hosts.cached(domain)
        if hosts is None:
            return None
        return receivers.shaped_receiver(hosts, self.table) or OTHER

    def cached_hosts(self, domain: str) -> tuple[str, ...] | None:
        """The MX hosts kept for `domain` (None: none kept now): for tests."""
        return self._hosts.cached(domain)

    async def _bounded_mx(self, domain: str) -> tuple[tuple[str, ...], float]:
        try:
            async with asyncio.timeout(self.dns.timeout):
                mx = await self.dns.lookup("MX", domain)
        except TimeoutError:
            return self._trouble(domain)
        found = receivers.mx_hosts(domain, mx)
        if found is None:
            return self._trouble(domain)
        return found

    def _trouble(self, domain: str) -> tuple[tuple[str, ...], float]:
        """No answer: the hosts an earlier lookup found, however long expired (RFC 8767), so
        that an outage does not release a paused receiver's mail; else none (never held),
        for TROUBLE_TTL."""
        self.troubles += 1
        return self._hosts.kept(domain) or (), TROUBLE_TTL
