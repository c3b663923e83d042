"""An event about a send whose owner died after the final dot (DESIGN.md §18: "a record
already unknown matches through the provider its attempt used, whatever happened to the
lease"). A real `serve` process is killed (-9) while the upstream holds its 250; the record
stays in flight under a lease nobody renews. A second instance on the same SQLite file
takes the provider's signed webhook: once the dead owner's lease is over the send is no
longer in flight, so the event applies, instead of `503` until the provider gives up."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiosmtplib

from tests.events.test_events import RCPT, events_config, events_port, suppressed
from tests.support import (
    Behaviour,
    FakeClock,
    GuardProcess,
    Upstream,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support import events as ev


async def test_an_event_for_a_send_whose_owner_died_after_the_dot_applies_once_its_lease_is_over(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=30)
    port = free_port()
    cfg = events_config(tmp, upstream, keys, {}, only="mailgun")
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    cfg["event_key"]["lease"] = "1s"
    proc = GuardProcess(write_config(tmp / "dead.yaml", cfg), tmp / "dead.log")
    proc.start()
    try:
        await proc.wait_port(port)
        sending = asyncio.create_task(
            send(port, message("invoice:1", to=RCPT), recipients=[RCPT], timeout=20)
        )
        await asyncio.wait_for(upstream.handler.arrived.wait(), 15)
        proc.kill()
        with contextlib.suppress(aiosmtplib.SMTPException, OSError):
            await sending
    finally:
        proc.kill()
    assert len(upstream.received) == 1
    message_id = upstream.received[0].header("Message-ID") or ""

    clock = FakeClock()
    cfg["listen"] = [{"address": "127.0.0.1:0", "tls": "none"}]
    async with running_guard(cfg, clock=clock) as guard:
        assert guard.store is not None
        record = await guard.store.get("acme", "invoice:1")
        assert record is not None and record.state.value == "in_flight" and record.via == "primary"
        signed = ev.mailgun(keys, ev.mailgun_event("failed", RCPT, message_id, severity="permanent"))
        # Within the dead owner's lease the send may still be in flight: the provider retries.
        clock.t = (record.lease_until or clock.t) - 0.5
        status, doc = await ev.post(events_port(guard), "mailgun", signed)
        assert status == 503, doc
        # The lease and the send timeout (3s) are long over: nobody is sending any more.
        clock.t = (record.lease_until or clock.t) + 60
        status, doc = await ev.post(events_port(guard), "mailgun", signed)
        assert (status, doc.get("applied")) == (200, 1), (status, doc)
        assert list(await suppressed(guard, "acme")) == [RCPT]
        status, doc = await ev.post(events_port(guard), "mailgun", signed)
        assert (status, doc.get("duplicate")) == (200, 1), (status, doc)
        # The zone's next mail to the bounced address is refused; the upstream still has one.
        reply = await send(guard.ports[0], message("invoice:2", to=RCPT), recipients=[RCPT])
        assert reply.code == 550, reply
    assert len(upstream.received) == 1
