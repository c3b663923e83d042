"""An upstream whose multi-line reply says two things at once (RFC 5321 §4.2.1: every line
of a reply carries the same code). After the final dot such a reply is no outcome: read as
its last line, `250-queued as A1` / `451 try later` would defer an event the provider may
have queued, and the client's retry would send it a second time. Counted on the wire:
the primary is the scripted server of tests/relay/test_wire_attacks.py, the standby the
recording upstream."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.outcome import Kind
from tests.relay.test_resilience import routed, smtp_provider, upstream_on
from tests.relay.test_wire_attacks import Scripted, _env, _provider, _send_all
from tests.support import Behaviour, FakeClock, message, running_guard, send
from tests.support.hostile import RawClient, SmtpReply, message_bytes, session, terminated

pytestmark = pytest.mark.usefixtures("no_tracebacks")

MIXED = [
    pytest.param(b"250-2.0.0 Ok: queued as A1\r\n451 4.3.0 try again later\r\n", id="250-then-451"),
    pytest.param(b"451-4.3.0 try again later\r\n250 2.0.0 Ok: queued as A2\r\n", id="451-then-250"),
    pytest.param(b"250-2.0.0 Ok: queued as A3\r\n550 5.1.1 no such user\r\n", id="250-then-550"),
    pytest.param(b"550-5.7.1 refused\r\n250 2.0.0 Ok: queued as A4\r\n", id="550-then-250"),
]


@pytest.mark.parametrize("dot", MIXED)
async def test_a_dot_answered_with_mixed_codes_is_unknown_and_never_sent_again(tmp: Path, dot: bytes) -> None:
    clock = FakeClock()
    async with Scripted(dot=[dot]) as primary, upstream_on() as standby:
        cfg = routed(tmp, smtp_provider("primary", primary.port), smtp_provider("standby", standby.port))
        async with running_guard(cfg, clock=clock) as guard:
            first = await send(guard.ports[0], message("mixed:1"))
            clock.t += 120  # past min_retry_interval: a deferred event would be sent again
            retry = await send(guard.ports[0], message("mixed:1"))
            assert guard.store is not None
            record = await guard.store.get("acme", "mixed:1")
    assert first.code == 451 and "unknown" in first.text, first
    assert retry.code == 451 and retry.text.startswith("4.3.0") and "held" in retry.text, retry
    assert record is not None and record.state == "unknown", record
    assert len(primary.messages) == 1
    assert standby.received == []


@pytest.mark.parametrize(
    "mail",
    [b"250-2.1.0 ok\r\n451 4.3.0 later\r\n", b"451-4.3.0 later\r\n250 2.1.0 ok\r\n"],
    ids=["250-then-451", "451-then-250"],
)
async def test_mixed_codes_before_the_dot_are_unavailable_and_fail_over(tmp: Path, mail: bytes) -> None:
    # Nothing of the message was written: the next provider may take it, and the session
    # that said two things is closed, never pooled.
    async with Scripted(mail=[mail]) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("b1"), _env("b2"))
    assert first.outcome.kind is Kind.UNAVAILABLE and first.failover, first.outcome
    assert not first.outcome.data_sent
    assert second.outcome.kind is Kind.DELIVERED and up.connections == 2
    assert len(up.messages) == 1


async def test_a_multi_line_reply_with_one_code_is_still_one_reply(tmp: Path) -> None:
    async with Scripted(dot=[b"250-2.0.0 first line\r\n250-more\r\n250 2.0.0 Ok: queued as M9\r\n"]) as up:
        (result,) = await _send_all(_provider(tmp, up.port), _env("one"))
    assert result.outcome.kind is Kind.DELIVERED and result.outcome.upstream_id == "M9"
    assert len(up.messages) == 1


@pytest.mark.parametrize(
    ("dot", "after_dot"),
    [
        pytest.param(
            b"250 2.0.0 Ok: queued as D1\r\n250 2.0.0 Ok: queued as D1 again\r\n", b"", id="same-write"
        ),
        pytest.param(b"250 2.0.0 Ok: queued as D1\r\n", b"250 2.0.0 Ok: queued as D1 again\r\n", id="late"),
    ],
)
async def test_a_dot_answered_twice_is_one_delivery_and_the_next_message_is_not_misread(
    tmp: Path, dot: bytes, after_dot: bytes
) -> None:
    # The second answer reaches a session pooled for the next message: it is dropped, or
    # taken for that message's MAIL, which puts the session out of step before anything of
    # it is written. Either way each event is at the upstream at most once, and only when
    # the relay says delivered.
    async with Scripted(dot=[dot], after_dot=after_dot) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("twice1"), _env("twice2"))
    assert first.outcome.kind is Kind.DELIVERED and first.outcome.upstream_id == "D1", first.outcome
    copies = [sum(f"Subject: {key}\r\n".encode() in m for m in up.messages) for key in ("twice1", "twice2")]
    assert copies[0] == 1
    if second.outcome.kind is Kind.DELIVERED:
        assert copies[1] == 1
    else:
        assert second.outcome.kind is Kind.UNAVAILABLE and second.failover, second.outcome
        assert copies[1] == 0


async def test_a_421_to_the_dot_reaches_the_client_as_451_and_its_session_goes_on(tmp: Path) -> None:
    # 421 closes the session it is given on (RFC 5321 §3.8): the provider closed its own
    # session with smtpguard, not the client's. Passed on as 421, the client (aiosmtplib,
    # smtplib, nodemailer) drops a session smtpguard keeps open; as 451 with the provider's
    # enhanced code and text, it defers the event and goes on.
    clock = FakeClock()
    async with Scripted(dot=[b"421 4.4.2 closing connection\r\n"]) as primary:
        cfg = routed(tmp, smtp_provider("primary", primary.port))
        async with running_guard(cfg, clock=clock) as guard, session(guard.ports[0]) as c:
            first = await _submit_on(c, "closing:1")
            second = await _submit_on(c, "closing:2")
            clock.t += 120  # past min_retry_interval: the deferred event is sent again
            retry = await _submit_on(c, "closing:1")
            assert guard.store is not None
            record = await guard.store.get("acme", "closing:1")
    assert first.code == 451 and first.enhanced == "4.4.2" and "closing connection" in first.text, first
    # The session goes on. The 421 throttles the provider (DESIGN.md §16): the next event
    # waits, nothing sent; past the throttle the deferred one is delivered.
    assert second.code == 451 and second.enhanced == "4.4.1", second
    assert retry.code == 250, retry
    assert record is not None and record.state == "delivered"
    assert len(primary.messages) == 2


async def _submit_on(c: RawClient, key: str) -> SmtpReply:
    for line in ("MAIL FROM:<billing@acme.example>", "RCPT TO:<customer@example.com>"):
        r = await c.command(line)
        assert r.code == 250, r
    return await c.data(terminated(message_bytes(key)))


@pytest.mark.parametrize("dot", [b"251 2.0.0 Ok: queued as W1\r\n", b"221 2.0.0 Bye, queued as W1\r\n"])
async def test_a_dot_taken_with_another_2xx_is_delivered_and_the_client_hears_250(
    tmp: Path, dot: bytes
) -> None:
    # RFC 5321 §4.3.2: 250 is the one success reply to the end of data, and clients accept
    # no other (aiosmtplib and smtplib raise on anything else). The provider took the
    # message (2xx): delivered, never resent, and the client hears so.
    async with Scripted(dot=[dot]) as primary:
        cfg = routed(tmp, smtp_provider("primary", primary.port))
        async with running_guard(cfg) as guard:
            first = await send(guard.ports[0], message("other2xx:1"))
            again = await send(guard.ports[0], message("other2xx:1"))
            assert guard.store is not None
            record = await guard.store.get("acme", "other2xx:1")
    assert first.code == 250 and "[sg:" in first.text, first
    assert again.code == 250 and "duplicate" in again.text, again
    assert record is not None and record.state == "delivered"
    assert record.attempts[-1].upstream_id == "W1", record.attempts
    assert len(primary.messages) == 1


async def test_a_dot_taken_with_another_2xx_after_a_refused_recipient_counts_the_ones_it_took(
    tmp: Path,
) -> None:
    # The reply to a message taken for some recipients names how many: a 251 after one
    # RCPT was refused said "accepted for 0" (only a 250 carried the accepted recipients).
    async with upstream_on() as primary:
        primary.handler.default = Behaviour(
            accept="251 2.0.0 Ok: queued as {queue_id}", rcpt={"gone@example.org": "550 5.1.1 no such user"}
        )
        cfg = routed(tmp, smtp_provider("primary", primary.port))
        async with running_guard(cfg) as guard:
            reply = await send(
                guard.ports[0],
                message("other2xx:some"),
                recipients=["customer@example.com", "gone@example.org"],
            )
    assert reply.code == 250, reply
    assert "accepted for 1, refused <gone@example.org> 550" in reply.text, reply
    assert len(primary.received) == 1
