"""One recipient of an event held at RCPT by its receiver (DESIGN.md §21) while the
transaction's others go: the client's queue retries the held one later with the same
message and key, as it would after a greylisting (docs/receivers.md). A real DNS server
(NSD), a real listener and a recording upstream: the held recipient must reach the upstream
once, the others never twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard import desk
from tests.support import Behaviour, Reply, Upstream, base_config, message, running_guard, send
from tests.support.dns import NsdServer
from tests.support.eventually import eventually

RECORDS = [
    "gm IN MX 5 aspmx.l.google.com.",
    "yh IN MX 1 mta5.am0.yahoodns.net.",
]


async def test_the_held_recipient_of_an_event_is_sent_when_the_client_retries_it(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    cfg = base_config(tmp, upstream.port)
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    cfg["receivers"] = {}
    async with running_guard(cfg) as guard:
        assert guard.store is not None and guard.assembly.receivers is not None
        await desk.set_receiver_paused(guard.store, "acme", "yahoo", True, "cli:test")
        await guard.assembly.receivers.gate.pauses.paused()  # the copy RCPT reads, fresh
        port = guard.ports[0]
        first = await send(port, message("k1"), recipients=["y@yh.test", "g@gm.test"])
        assert first.code == 451 and first.text.startswith("4.7.1"), first
        await upstream.wait_received(1)
        assert [r.rcpt_tos for r in upstream.received] == [["g@gm.test"]]
        await desk.set_receiver_paused(guard.store, "acme", "yahoo", False, "cli:test")
        await guard.assembly.receivers.gate.pauses.paused()
        # The client's queue retries the held recipient alone: the same message, key and all.
        retry = await send(port, message("k1"), recipients=["y@yh.test"])
        replies = [(first.code, first.text), (retry.code, retry.text)]
        print("replies:", replies, "upstream:", [r.rcpt_tos for r in upstream.received])
        assert retry.code == 250 and "duplicate" not in retry.text, retry
        await upstream.wait_received(2)
        # Retried again (its 250 lost on the way back), and the whole message again: nothing
        # more is sent to anyone.
        again = await send(port, message("k1"), recipients=["y@yh.test"])
        whole = await send(port, message("k1"), recipients=["y@yh.test", "g@gm.test"])
        assert again.code == 250 and "duplicate" in again.text, again
        assert whole.code == 250 and "duplicate" in whole.text, whole
        assert [r.rcpt_tos for r in upstream.received] == [["g@gm.test"], ["y@yh.test"]]


async def test_a_deferred_event_retried_while_a_receiver_is_paused_goes_to_the_others(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    """The upstream defers an event to two recipients; before the client's retry, one's
    receiver is paused. The retry names both (what the client's queue holds) and one is held
    at RCPT: it is still this event (its fingerprint covers both), sent to the other, and
    the held one goes when the client retries it."""
    cfg = base_config(tmp, upstream.port, event_key__min_retry_interval="1s")
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    cfg["receivers"] = {}
    upstream.handler.script.append(Behaviour(data="451 4.3.0 try later"))
    both = ["y@yh.test", "g@gm.test"]
    async with running_guard(cfg) as guard:
        assert guard.store is not None and guard.assembly.receivers is not None
        port = guard.ports[0]
        first = await send(port, message("k1"), recipients=both)
        assert first.code == 451 and first.text.startswith("4.3.0"), first
        await desk.set_receiver_paused(guard.store, "acme", "yahoo", True, "cli:test")
        await guard.assembly.receivers.gate.pauses.paused()

        async def retry() -> Reply:
            return await send(port, message("k1"), recipients=both)

        held = await eventually(retry, lambda r: "Event k1" not in r.text, timeout=10, interval=0.3)
        assert held.code == 451 and "yahoo" in held.text, held  # RCPT y; g's DATA went
        await upstream.wait_received(1)
        await desk.set_receiver_paused(guard.store, "acme", "yahoo", False, "cli:test")
        await guard.assembly.receivers.gate.pauses.paused()
        rest = await send(port, message("k1"), recipients=["y@yh.test"])
        assert rest.code == 250 and "duplicate" not in rest.text, rest
        assert [r.rcpt_tos for r in upstream.received] == [["g@gm.test"], ["y@yh.test"]]


@pytest.mark.parametrize("queued", [False, True], ids=["relay", "queue"])
async def test_a_recipient_the_provider_refused_is_not_counted_as_sent(
    tmp: Path, upstream: Upstream, dns_server: NsdServer, queued: bool
) -> None:
    """`smtpguard_receiver_sends_total` counts recipients relayed (docs/receivers.md): one
    the provider refused at its RCPT, while it took the message for the others, was not."""
    cfg = base_config(tmp, upstream.port)
    if queued:
        cfg["zones"]["acme"]["delivery"] = "queue"
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    cfg["receivers"] = {}
    upstream.handler.script.append(Behaviour(rcpt={"y@yh.test": "550 5.1.1 no such user"}))
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("k1"), recipients=["y@yh.test", "g@gm.test"])
        assert reply.code == 250, reply
        await upstream.wait_received(1)
        assert [r.rcpt_tos for r in upstream.received] == [["g@gm.test"]]
        sends = guard.metrics.receiver_sends
        gmail = sends.labels("acme", "gmail")
        await eventually(lambda: gmail._value.get(), lambda v: v == 1, timeout=5, interval=0.05)
        assert sends.labels("acme", "yahoo")._value.get() == 0
        assert guard.store is not None
        counted = await eventually(
            lambda: guard.store.counts("acme") if guard.store else None,
            lambda c: c is not None and c.get("receiver:gmail:sent") == 1,
            timeout=10,
            interval=0.1,
        )
        assert counted is not None and "receiver:yahoo:sent" not in counted
