"""A resolver that has gone away (reads queries, never answers) under a transaction to many
recipient domains (DESIGN.md §21: DNS trouble never holds mail up, one bounded wait). In
queue mode RCPT has nothing to decide from a receiver (the entry waits at delivery), so it
waits for no MX lookup; a recipient list's lookups are made together, not one after the
other, so an entry of many domains waits dns.timeout, not dns.timeout per domain."""

from __future__ import annotations

import asyncio
from pathlib import Path

from smtpguard.config import DnsConfig
from smtpguard.policy.receivers import DEFAULT_RECEIVERS
from smtpguard.readiness.dns import DnsClient
from smtpguard.receivers.lookup import ReceiverLookup
from tests.support import Upstream, base_config, message, running_guard, send
from tests.support.dns import bad_resolver

DOMAINS = 12


async def test_queue_mode_rcpt_waits_for_no_mx_lookup(tmp: Path, upstream: Upstream) -> None:
    recipients = [f"a@d{i}.test" for i in range(DOMAINS)]
    with bad_resolver(silent=True) as resolver:
        cfg = base_config(tmp, upstream.port, zones__acme__delivery="queue")
        cfg["dns"] = {"nameservers": [resolver.nameserver], "timeout": "1s"}
        cfg["receivers"] = {}
        cfg["zones"]["acme"]["receivers"] = {"gmail": {"paused": True}}
        async with running_guard(cfg) as guard:
            loop = asyncio.get_running_loop()
            started = loop.time()
            reply = await send(guard.ports[0], message("k1"), recipients=recipients)
            took = loop.time() - started
            assert reply.code == 250 and "queued" in reply.text, reply
            await upstream.wait_received(1, timeout=10)
            assert [r.rcpt_tos for r in upstream.received] == [recipients]
            receivers = guard.assembly.receivers
            assert receivers is not None and receivers.lookup.troubles == DOMAINS
    print(f"transaction of {DOMAINS} domains took {took:.1f}s")
    # One RCPT after another, each waiting for its domain's lookup, took DOMAINS seconds.
    assert took < DOMAINS / 3, f"{took:.1f}s for {DOMAINS} RCPTs with dns.timeout 1s"


async def test_a_recipient_lists_lookups_are_made_together() -> None:
    with bad_resolver(silent=True) as resolver:
        lookup = ReceiverLookup(
            DnsClient(DnsConfig(nameservers=[resolver.nameserver], timeout=1.0)), DEFAULT_RECEIVERS
        )
        async with asyncio.timeout(DOMAINS / 3):
            found = await lookup.shaped_all([f"a@d{i}.test" for i in range(DOMAINS)] + ["b@d0.test"])
    assert found == [None] * (DOMAINS + 1)
    assert lookup.troubles == DOMAINS and lookup.lookups == DOMAINS
