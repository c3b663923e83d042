"""A paused receiver (DESIGN.md §21) while DNS goes away: the resolver that answered a
domain's MX stops answering once the answer's TTL is over. DNS trouble never holds mail up
for a domain nobody could match, but a domain whose MX hosts were known a moment ago is
still that receiver's: an outage must not let a paused receiver's mail (or a backlog held
for it) out. A real DNS server (NSD) stopped mid-test, a real listener, a recording
upstream."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard import desk
from tests.support import Upstream, base_config, message, running_guard, send
from tests.support.dns import nsd
from tests.support.eventually import eventually

RECORDS = ["gm 1 IN MX 5 aspmx.l.google.com.", "plain 1 IN MX 10 mx.hosting.example."]


@pytest.mark.parametrize("queued", [False, True], ids=["relay", "queue"])
async def test_a_dns_outage_does_not_release_a_paused_receivers_mail(
    tmp: Path, upstream: Upstream, queued: bool
) -> None:
    with nsd(tmp / "dns", "test", RECORDS, ttl=1, negative=1) as server:
        cfg = base_config(tmp, upstream.port)
        if queued:
            cfg["zones"]["acme"]["delivery"] = "queue"
        cfg["dns"] = {"nameservers": [server.nameserver], "timeout": "1s"}
        cfg["receivers"] = {}
        async with running_guard(cfg) as guard:
            receivers = guard.assembly.receivers
            assert guard.store is not None and receivers is not None
            port = guard.ports[0]
            # Known: both domains' MX hosts looked up while DNS answers.
            first = await send(port, message("k0"), recipients=["a@gm.test", "b@plain.test"])
            assert first.code == 250, first
            await upstream.wait_received(1)
            await desk.set_receiver_paused(guard.store, "acme", "gmail", True, "cli:test")
            await receivers.gate.pauses.paused()
            server.stop()
            await eventually(
                lambda: receivers.lookup.cached_hosts("gm.test"), lambda h: h is None, timeout=5, interval=0.1
            )
            reply = await send(port, message("k1"), recipients=["a@gm.test", "b@plain.test"])
            # plain.test is no receiver's either way; gm.test stays gmail's, and gmail is paused.
            if queued:
                assert reply.code == 250 and "queued" in reply.text, reply
            else:
                assert reply.code == 451 and "gmail" in reply.text, reply
            await upstream.wait_received(2 if not queued else 1, timeout=10)
            if queued:
                rec = await eventually(
                    lambda: guard.store.get("acme", "k1") if guard.store else None,
                    lambda r: r is not None and receivers.lookup.troubles >= 1,
                    timeout=10,
                    interval=0.1,
                )
                assert rec is not None and rec.state.value == "queued", rec
            print("upstream:", [r.rcpt_tos for r in upstream.received], "troubles", receivers.lookup.troubles)
            sent = [r.rcpt_tos for r in upstream.received]
            assert all("a@gm.test" not in t for t in sent[1:]), sent
            assert receivers.lookup.troubles >= 1
