"""MX answers a recipient domain's owner writes to be taken for a receiver it is not at
(DESIGN.md §21: suffixes match on label boundaries). A real DNS server (NSD), the receiver
lookup's real resolver and cache: only MX hosts whose labels end in a receiver's suffix are
that receiver; CNAME chains are followed; loops, null MX and extreme TTLs are bounded."""

from __future__ import annotations

import asyncio

from smtpguard.config import DnsConfig
from smtpguard.policy.receivers import DEFAULT_RECEIVERS, MAX_TTL, MIN_TTL
from smtpguard.readiness.dns import DnsClient
from smtpguard.receivers.lookup import ReceiverLookup
from tests.support.dns import NsdServer

RECORDS = [
    "gm IN MX 5 aspmx.l.google.com.",
    # One label `evil.google` under `com`: written `evil\.google.com`, not under google.com.
    "dotted IN MX 5 mx.evil\\.google.com.",
    "dotted2 IN MX 5 evil\\.outlook.com.",
    "suffixed IN MX 5 google.com.evil.example.",
    "glued IN MX 5 evilgoogle.com.",
    "spaced IN MX 5 mx.x\\032google.com.",
    # The escaped host is not a receiver; the next preferred one still decides.
    "mixed IN MX 1 mx.evil\\.google.com.",
    "mixed IN MX 9 ms-test.mail.protection.outlook.com.",
    "eu IN MX 5 acme-eu.mail.eu.outlook.com.",
    "ms IN MX 5 acme.mail.protection.outlook.com.",
    "cn IN CNAME gm",
    "cn2 IN CNAME cn",
    "loop1 IN CNAME loop2",
    "loop2 IN CNAME loop1",
    "null IN MX 0 .",
    "ttl0 0 IN MX 5 aspmx.l.google.com.",
    "ttlbig 2147483647 IN MX 5 aspmx.l.google.com.",
]

EXPECTED = {
    "gm.test": "gmail",
    "dotted.test": "other",
    "dotted2.test": "other",
    "suffixed.test": "other",
    "glued.test": "other",
    "spaced.test": "other",
    "mixed.test": "microsoft",
    "cn.test": "gmail",
    "cn2.test": "gmail",
    "null.test": "other",
    "ttl0.test": "gmail",
    "ttlbig.test": "gmail",
}


async def test_only_labels_under_a_suffix_are_its_receiver(dns_server: NsdServer) -> None:
    now = [1000.0]
    dns = DnsClient(DnsConfig(nameservers=[dns_server.nameserver], timeout=2.0))
    lookup = ReceiverLookup(dns, DEFAULT_RECEIVERS, clock=lambda: now[0])
    found = {d: await lookup.receiver(f"a@{d}") for d in EXPECTED}
    print("receivers:", found)
    assert found == EXPECTED
    assert lookup.troubles == 0
    # A CNAME loop is DNS trouble: counted `other`, never held as one, within dns.timeout.
    async with asyncio.timeout(3):
        assert await lookup.shaped("a@loop1.test") is None
    assert lookup.troubles == 1
    # TTL 0 is kept for a second (one lookup per burst), 2^31 - 1 for a day at most.
    lookups = lookup.lookups
    await lookup.receiver("a@ttl0.test")
    await lookup.receiver("a@ttlbig.test")
    assert lookup.lookups == lookups
    now[0] += MIN_TTL + 0.5
    await lookup.receiver("a@ttl0.test")
    await lookup.receiver("a@ttlbig.test")
    assert lookup.lookups == lookups + 1
    now[0] += MAX_TTL
    await lookup.receiver("a@ttlbig.test")
    assert lookup.lookups == lookups + 2


async def test_the_most_specific_suffix_decides(dns_server: NsdServer) -> None:
    """A receiver the config adds under a built-in's suffix (`eu.outlook.com` under
    microsoft's `outlook.com`) is the receiver of hosts under it, whatever the table's
    order: else its max_rate and pause would never apply to anyone."""
    table = {**DEFAULT_RECEIVERS, "ms-eu": ("eu.outlook.com",), "wide": ("com",)}
    dns = DnsClient(DnsConfig(nameservers=[dns_server.nameserver], timeout=2.0))
    lookup = ReceiverLookup(dns, table)
    assert await lookup.receiver("a@eu.test") == "ms-eu"
    assert await lookup.receiver("a@ms.test") == "microsoft"
    assert await lookup.receiver("a@gm.test") == "gmail"
    assert await lookup.receiver("a@glued.test") == "wide"  # only `com` is under evilgoogle.com
