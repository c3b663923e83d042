"""Receiving providers (DESIGN.md §21) under hostile DNS: answers an attacker controls, from a
real DNS server (NSD), through the receiver lookup's real resolver and cache."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator

import pytest

from smtpguard.config import DnsConfig
from smtpguard.policy.receivers import DEFAULT_RECEIVERS, MAX_HOSTS
from smtpguard.readiness.dns import DnsClient
from smtpguard.receivers.lookup import ReceiverLookup
from tests.support.dns import NsdServer, nsd

# One wildcard name gives every domain under it a large MX set (TCP-sized: hundreds of long
# host names), the most preferred of them at Google: an attacker needs one zone, not many.
BIG = 300
RECORDS = [
    *(f"*.big IN MX {10 + i} {'h' * 50}{i:03d}.{'x' * 40}.mx.example." for i in range(BIG)),
    "*.big IN MX 5 aspmx.l.google.com.",
]


@pytest.fixture(scope="module")
def hostile_dns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsdServer]:
    with nsd(tmp_path_factory.mktemp("dns"), "test", RECORDS, ttl=300, negative=60) as server:
        yield server


async def test_huge_mx_answers_for_many_domains_keep_the_cache_small(hostile_dns: NsdServer) -> None:
    lookup = ReceiverLookup(DnsClient(DnsConfig(nameservers=[hostile_dns.nameserver])), DEFAULT_RECEIVERS)
    domains = 10
    await lookup.receiver("a@warm.big.test")  # the resolver's own first-use allocations
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.take_snapshot()
        found = [await lookup.receiver(f"a@d{i}.big.test") for i in range(domains)]
        gc.collect()  # what is only garbage by now does not count
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert found == ["gmail"] * domains  # the most preferred host still decides
    assert lookup.lookups == domains + 1
    hosts = lookup.cached_hosts("d0.big.test")
    assert hosts is not None and hosts[0] == "aspmx.l.google.com" and len(hosts) <= MAX_HOSTS
    # What the cache keeps per domain (measured, not the answer's size): 10,000 domains of
    # this kind must stay well under 100 MB.
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown / domains < 10_000, f"{grown / domains:.0f} bytes kept per domain"
