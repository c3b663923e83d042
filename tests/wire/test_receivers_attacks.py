"""Receiving providers (DESIGN.md §21) under hostile DNS: answers an attacker controls, from a
real DNS server (NSD), through the receiver lookup's real resolver and cache."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from smtpguard.config import DnsConfig
from smtpguard.policy.receivers import DEFAULT_RECEIVERS, MAX_HOSTS
from smtpguard.readiness.dns import DnsClient
from smtpguard.receivers.lookup import ReceiverLookup
from tests.support import Upstream, base_config, message, running_guard, send
from tests.support.dns import NsdServer, bad_resolver, nsd
from tests.support.eventually import eventually

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


async def test_a_silent_resolver_delays_rcpt_once_with_both_dns_checks(tmp: Path, upstream: Upstream) -> None:
    """`recipient_domains: check` and receivers each look the domain's MX up. With a resolver
    that never answers, RCPT waits for dns.timeout (the bound docs/configuration.md gives),
    not once per lookup: the two waits overlap. (Each lookup waits its full lifetime, so one
    after the other takes at least twice dns.timeout.)"""
    with bad_resolver(silent=True) as resolver:
        cfg = base_config(tmp, upstream.port, zones__acme__recipient_domains="check")
        cfg["dns"] = {"nameservers": [resolver.nameserver], "timeout": "2s"}
        cfg["receivers"] = {}
        async with running_guard(cfg) as guard:
            loop = asyncio.get_running_loop()
            started = loop.time()
            reply = await send(guard.ports[0], message("k1"), recipients=["a@slow.test"])
            took = loop.time() - started
            assert reply.code == 250, reply
            await upstream.wait_received(1)
            receivers = guard.assembly.receivers
            assert receivers is not None and receivers.lookup.troubles == 1
            assert took < 3.5, f"RCPT took {took:.1f}s with dns.timeout 2s"


@pytest.mark.parametrize("queued", [False, True], ids=["relay", "queue"])
async def test_dns_trouble_is_never_shaped_as_other(tmp: Path, upstream: Upstream, queued: bool) -> None:
    """A zone that pauses (or rate-limits) `other` holds mail to providers it does not know.
    A recipient whose MX could not be found is counted as `other`, but DNS trouble never
    holds mail (§12, §21): with a resolver down, its recipients still go, in both modes."""
    with bad_resolver(silent=False) as resolver:  # SERVFAIL to everything
        cfg = base_config(tmp, upstream.port)
        if queued:
            cfg["zones"]["acme"]["delivery"] = "queue"
        cfg["dns"] = {"nameservers": [resolver.nameserver], "timeout": "1s"}
        cfg["receivers"] = {}
        cfg["zones"]["acme"]["receivers"] = {"other": {"paused": True}}
        async with running_guard(cfg) as guard:
            reply = await send(guard.ports[0], message("k1"), recipients=["a@gm.test"])
            assert reply.code == 250, reply
            await upstream.wait_received(1, timeout=10)
            assert [r.rcpt_tos for r in upstream.received] == [["a@gm.test"]]
            receivers = guard.assembly.receivers
            assert receivers is not None and receivers.lookup.troubles == 1
            # Still counted: as `other`, the only name there is for it (in queue mode once
            # the worker has the upstream's reply).
            sends = guard.metrics.receiver_sends.labels("acme", "other")
            counted = await eventually(lambda: sends._value.get(), lambda n: n == 1, timeout=5, interval=0.05)
            assert counted == 1
