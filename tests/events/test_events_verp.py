"""Mailed reports prove where they come from (DESIGN.md §18): relayed mail leaves with a
VERP envelope sender, and a DSN or ARF report mailed to the events mailbox has effects only
at a token that verifies, for the message's recipients. A real client submits through the
guard to a recording upstream; a real SMTP client mails the report to the mailbox
listener; the victim's next message is counted at the upstream."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pytest

from smtpguard.policy import verp
from smtpguard.policy.eventkey import message_id_for
from smtpguard.server import Server
from tests.events.test_events import RCPT, sent, suppressed
from tests.events.test_events_mailbox import (
    MAILBOX,
    VERP_DOMAIN,
    bounce_address,
    deliver,
    dsn,
    mailbox_config,
    verp_secret,  # noqa: F401 - the fixture, autouse here too
)
from tests.support import (
    OTHER_PASSWORD,
    Behaviour,
    FakeClock,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
)
from tests.support.eventually import eventually

_VERP = re.compile(r"^b\+([0-9a-f]+)-([0-9a-f]{20})@" + re.escape(VERP_DOMAIN) + "$")


async def _guard(tmp: Path, upstream: Upstream, verp_on: bool = True, **more: Any) -> Any:
    cfg = base_config(tmp, upstream.port, events={"mailbox": mailbox_config(verp_on)}, **more)
    return running_guard(cfg)


async def _victim_still_gets_mail(guard: Server, upstream: Upstream, key: str) -> None:
    """The zone's next message to the victim reaches the upstream (not 550 5.1.1)."""
    before = len(upstream.received)
    reply = await send(guard.ports[0], message(key, to=RCPT), recipients=[RCPT])
    assert reply.code == 250, reply
    assert len(upstream.received) == before + 1


async def _wait_received(upstream: Upstream, n: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while len(upstream.received) < n:
        assert time.monotonic() < deadline, f"upstream has {len(upstream.received)} of {n}"
        await asyncio.sleep(0.02)


def forged(message_id: str, to: str = RCPT) -> bytes:
    """A DSN anyone can write: it quotes the victim message's Message-ID and nothing else."""
    return dsn(f"From: billing@acme.example\r\nMessage-ID: {message_id}\r\nSubject: x", to=to)


@pytest.mark.parametrize("verp_on", [False, True], ids=["no-domain", "verp"])
async def test_a_forged_dsn_quoting_the_message_id_suppresses_nothing(
    tmp: Path, upstream: Upstream, verp_on: bool
) -> None:
    async with await _guard(tmp, upstream, verp_on) as guard:
        message_id, _ = await sent(guard, upstream, "invoice:1")
        assert (await deliver(guard, forged(message_id)))[0] == 250
        assert await suppressed(guard, "acme") == {}
        assert guard.store is not None
        (event,) = await guard.store.provider_events("acme", "invoice:1")
        assert (event.type, event.recipient, event.effect) == ("bounce", RCPT, "unverified")
        await _victim_still_gets_mail(guard, upstream, "invoice:2")
        assert len(upstream.received) == 2


async def test_a_forged_dsn_quoting_the_computable_default_message_id_suppresses_nothing(
    tmp: Path, upstream: Upstream
) -> None:
    async with await _guard(tmp, upstream, verp_on=False) as guard:
        await sent(guard, upstream, "invoice:1")  # the client wrote no Message-ID
        computed = message_id_for("acme", "invoice:1", "guard.test")
        assert upstream.received[0].header("Message-ID") == computed
        assert (await deliver(guard, forged(computed)))[0] == 250
        assert await suppressed(guard, "acme") == {}
        await _victim_still_gets_mail(guard, upstream, "invoice:2")
        assert len(upstream.received) == 2


async def test_a_tampered_or_foreign_token_suppresses_nothing(tmp: Path, upstream: Upstream) -> None:
    async with await _guard(tmp, upstream) as guard:
        message_id, _ = await sent(guard, upstream, "invoice:1")
        genuine = bounce_address(upstream)
        m = _VERP.match(genuine)
        assert m is not None
        sg_id, mac = m.groups()
        flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
        wrong_secret = verp.sender(b"another secret", sg_id, VERP_DOMAIN)
        headers = upstream.received[0].content.split(b"\r\n\r\n", 1)[0].decode()
        for rcpt in (f"b+{sg_id}-{flipped}@{VERP_DOMAIN}", wrong_secret, f"b+{sg_id}@{VERP_DOMAIN}"):
            # Taken (a refusal would bounce a bounce), recorded as unverified, no effect.
            assert (await deliver(guard, dsn(headers), rcpt))[0] == 250
        assert await suppressed(guard, "acme") == {}
        assert guard.store is not None
        effects = {e.effect for e in await guard.store.provider_events("acme", "invoice:1")}
        assert effects == {"unverified"}
        await _victim_still_gets_mail(guard, upstream, "invoice:2")
        # The genuine token still works after all that: one suppression, the next mail refused.
        assert (await deliver(guard, dsn(headers), genuine))[0] == 250
        assert await suppressed(guard, "acme") == {RCPT: "bounce 5.1.1 via mailbox"}
        reply = await send(guard.ports[0], message("invoice:3", to=RCPT), recipients=[RCPT])
        assert reply.code == 550
        assert len(upstream.received) == 2
        assert message_id


async def test_a_token_of_one_message_cannot_suppress_a_recipient_of_another(
    tmp: Path, upstream: Upstream
) -> None:
    async with await _guard(tmp, upstream) as guard:
        await sent(guard, upstream, "invoice:1", to="someone@example.org")
        attacker_token = bounce_address(upstream)
        victim_mid, _ = await sent(guard, upstream, "invoice:2")
        # The attacker's own token, the victim message's headers and recipient.
        assert (await deliver(guard, forged(victim_mid), attacker_token))[0] == 250
        assert await suppressed(guard, "acme") == {}
        assert guard.store is not None
        (event,) = await guard.store.provider_events("acme", "invoice:1")
        assert (event.recipient, event.effect) == (RCPT, "unverified")
        assert await guard.store.provider_events("acme", "invoice:2") == []
        await _victim_still_gets_mail(guard, upstream, "invoice:3")
        assert len(upstream.received) == 3


async def test_every_relayed_message_leaves_with_a_verp_sender_through_every_provider(
    tmp: Path, upstream: Upstream
) -> None:
    dead = free_port()  # nothing listens: the route fails over to the standby
    providers = [
        {
            "name": "primary",
            "kind": "smtp",
            "host": "127.0.0.1",
            "port": dead,
            "tls": "none",
            "timeouts": {"connect": "1s", "command": "5s", "data": "3s"},
        },
        {
            "name": "standby",
            "kind": "smtp",
            "host": "127.0.0.1",
            "port": upstream.port,
            "tls": "none",
            "timeouts": {"connect": "2s", "command": "5s", "data": "3s"},
        },
    ]
    async with await _guard(tmp, upstream, providers=providers, zones__globex__delivery="queue") as guard:
        assert (await send(guard.ports[0], message("relay:1"), recipients=["a@example.com"])).code == 250
        reply = await send(
            guard.ports[0],
            message("queue:1", sender="ops@globex.example"),
            user="globex-app",
            password=OTHER_PASSWORD,
            sender="ops@globex.example",
            recipients=["b@example.com"],
        )
        assert reply.code == 250, reply
        await _wait_received(upstream, 2)
        assert len(upstream.received) == 2
        assert guard.store is not None
        store = guard.store
        for got, zone, key, header_from in (
            (upstream.received[0], "acme", "relay:1", "billing@acme.example"),
            (upstream.received[1], "globex", "queue:1", "ops@globex.example"),
        ):
            m = _VERP.match(got.mail_from)
            assert m is not None, got.mail_from
            # The queue's worker records the delivery just after the upstream has the message.
            record = await eventually(
                lambda z=zone, k=key: store.get(z, k),
                lambda r: r is not None and r.state.value == "delivered",
                timeout=10,
                interval=0.02,
            )
            assert record is not None and record.sg_id == m.group(1)
            assert [a.provider for a in record.attempts][-1] == "standby"
            assert record.sender == header_from  # the client's envelope sender, kept
            assert got.header("From") == header_from  # the header From is never touched


async def test_a_report_for_a_message_still_in_flight_is_a_temporary_failure(
    tmp: Path, upstream: Upstream
) -> None:
    async with await _guard(tmp, upstream) as guard:
        upstream.handler.default = Behaviour(hang_after_dot=1.5)
        sending = asyncio.create_task(send(guard.ports[0], message("invoice:1", to=RCPT), recipients=[RCPT]))
        await asyncio.wait_for(upstream.handler.arrived.wait(), 10)
        headers = upstream.received[0].content.split(b"\r\n\r\n", 1)[0].decode()
        bounces = bounce_address(upstream)
        code, text = await deliver(guard, dsn(headers), bounces)
        assert code == 451 and "4.3.2" in text, (code, text)
        assert await suppressed(guard, "acme") == {}
        assert (await sending).code == 250
        # The reporting MTA retries: now the outcome is written, and the report applies once.
        assert (await deliver(guard, dsn(headers), bounces))[0] == 250
        assert await suppressed(guard, "acme") == {RCPT: "bounce 5.1.1 via mailbox"}
        assert len(upstream.received) == 1


async def test_the_mailbox_still_refuses_other_addresses_with_verp_on(tmp: Path, upstream: Upstream) -> None:
    async with await _guard(tmp, upstream) as guard:
        for rcpt in ("someone@example.com", f"x+abc@{VERP_DOMAIN}", "b+00-00@other.example"):
            code, text = await deliver(guard, b"Subject: hi\r\n\r\nrelay me\r\n", rcpt)
            assert code == 550 and "5.1.1" in text, (rcpt, code, text)
        assert (await deliver(guard, b"Subject: hi\r\n\r\njust mail\r\n", MAILBOX))[0] == 250
        assert upstream.received == []


async def test_a_report_at_an_earlier_attempts_token_applies_to_the_record_that_sent_it(
    tmp: Path, upstream: Upstream
) -> None:
    # A derived key (no X-Event-Key): after its window the same message is a new event on
    # the same record, with a new sg id. A complaint or late bounce about the first one
    # comes back to the first token, which still verifies.
    clock = FakeClock()
    cfg = base_config(
        tmp,
        upstream.port,
        events={"mailbox": mailbox_config()},
        zones__acme__missing_key="derive",
        zones__acme__derive_window="10s",
    )
    async with running_guard(cfg, clock=clock) as guard:
        other_mid, _ = await sent(guard, upstream, "invoice:9", to="someone@example.org")
        assert (await send(guard.ports[0], message(None, to=RCPT), recipients=[RCPT])).code == 250
        first_token = bounce_address(upstream)
        first_headers = upstream.received[-1].content.split(b"\r\n\r\n", 1)[0].decode()
        clock.t += 11
        assert (await send(guard.ports[0], message(None, to=RCPT), recipients=[RCPT])).code == 250
        assert bounce_address(upstream) != first_token
        # The first token quoting another record's message: that record never had the
        # attempt, so it is history at most, and nothing is suppressed.
        quoted = f"From: billing@acme.example\r\nMessage-ID: {other_mid}\r\nSubject: x"
        assert (await deliver(guard, dsn(quoted, to="someone@example.org"), first_token))[0] == 250
        assert await suppressed(guard, "acme") == {}
        # The genuine report about the first message: applied, once.
        assert (await deliver(guard, dsn(first_headers), first_token))[0] == 250
        assert await suppressed(guard, "acme") == {RCPT: "bounce 5.1.1 via mailbox"}
        assert (await deliver(guard, dsn(first_headers), first_token))[0] == 250
        reply = await send(guard.ports[0], message("invoice:10", to=RCPT), recipients=[RCPT])
        assert reply.code == 550, reply
        assert len(upstream.received) == 3
