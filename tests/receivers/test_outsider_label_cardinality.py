"""The `receiver` label is bounded by the config (DESIGN.md §21), attacked with 1,000 random
recipient domains — some at Google, most at hosts of nobody's, some that do not exist —
sent through a real listener with a real DNS server (NSD), and provider events naming random
recipients and made-up types: the metrics keep one series per configured receiver and
`other`, and every recipient is counted once."""

from __future__ import annotations

import random
import re
from pathlib import Path

from tests.support import Upstream, base_config, message, running_guard, send
from tests.support.dns import NsdServer
from tests.support.eventually import eventually

RECORDS = [
    "*.g IN MX 5 aspmx.l.google.com.",
    "*.r IN MX 10 mx.hosting.example.",
]
DOMAINS = 1000
PER_MESSAGE = 100


async def test_a_thousand_random_domains_make_no_new_series(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    rng = random.Random(7)
    kinds = ["g", "r", "nx"]  # at Google, at a host of nobody's, no such domain
    recipients = [f"a@{rng.getrandbits(40):x}.{kinds[i % 3]}.test" for i in range(DOMAINS)]
    cfg = base_config(tmp, upstream.port)
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    cfg["receivers"] = {}
    async with running_guard(cfg) as guard:
        for n in range(DOMAINS // PER_MESSAGE):
            batch = recipients[n * PER_MESSAGE : (n + 1) * PER_MESSAGE]
            reply = await send(guard.ports[0], message(f"k{n}"), recipients=batch)
            assert reply.code == 250, reply
        await upstream.wait_received(DOMAINS // PER_MESSAGE)
        receivers = guard.assembly.receivers
        assert receivers is not None
        kinds_sent = [rng.choice(["bounce", f"t{i}"]) for i in range(DOMAINS)]
        for kind in kinds_sent:
            receivers.event("acme", f"x@{rng.getrandbits(40):x}.r.test", kind)
        gmail = sum(1 for r in recipients if r.endswith(".g.test"))
        sends = guard.metrics.receiver_sends
        await eventually(
            lambda: sends.labels("acme", "other")._value.get(),
            lambda v: v == DOMAINS - gmail,
            timeout=10,
            interval=0.1,
        )
        events = guard.metrics.receiver_events.labels("acme", "other", "bounce")
        bounces = kinds_sent.count("bounce")
        await eventually(lambda: events._value.get(), lambda v: v == bounces, timeout=10, interval=0.1)
        text = guard.metrics.render().decode()
    series = set(re.findall(r"^smtpguard_receiver_\w+\{[^}]*\}", text, re.MULTILINE))
    print(len(series), "series:", sorted(series))
    labels = set(re.findall(r'receiver="([^"]*)"', text))
    assert labels <= {"gmail", "microsoft", "yahoo", "apple", "other"}
    assert sends.labels("acme", "gmail")._value.get() == gmail
    assert len(series) <= 5 * 2 + 5 * 4 * 2
    types = set(re.findall(r'type="([^"]*)"', text))
    assert types <= {"delivered", "deferred", "bounce", "complaint"}
