"""8-bit messages and the upstream's 8BITMIME (RFC 6152). smtpguard's listener offers
8BITMIME, so a client may hand it a message with octets above 127. RFC 6152 §3: such a
message must not be relayed to a server that does not offer 8BITMIME; the relay refuses it
with a clear reply (or converts it, which smtpguard does not: it never rewrites a message).
To a server that offers it, MAIL declares BODY=8BITMIME. Counted on the wire: the scripted
server of tests/relay/test_wire_attacks.py records every command and message."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.events import tag_value
from smtpguard.policy.outcome import Kind
from smtpguard.relay import Envelope
from smtpguard.store import CapUsage
from tests.relay.test_resilience import routed, smtp_provider
from tests.relay.test_wire_attacks import Scripted, _env, _provider, _send_all
from tests.support import FakeClock, SmtpSink, running_guard, send
from tests.support.utf8 import cap_usage

SENDER, CUSTOMER = "billing@acme.example", "customer@example.com"

pytestmark = pytest.mark.usefixtures("no_tracebacks")

LATIN1 = b"Prix: 10 \xe9cus\r\n"
UTF8 = "Grüße, Zoë\r\n".encode()

KEY = "invoice:8bit:1"


def _raw(key: str, body: bytes) -> bytes:
    return (
        b"From: billing@acme.example\r\nTo: customer@example.com\r\n"
        + f"Subject: s\r\nX-Event-Key: {key}\r\n".encode()
        + b"Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n"
        + body
    )


def _mails(up: Scripted) -> list[bytes]:
    return [c for c in up.commands if c.upper().startswith(b"MAIL")]


@pytest.mark.parametrize("body", [LATIN1, UTF8], ids=["latin1", "utf8"])
async def test_an_8bit_message_is_never_written_to_an_upstream_without_8bitmime(
    tmp: Path, body: bytes
) -> None:
    async with Scripted(eightbitmime=False) as up:
        eight, seven = await _send_all(
            _provider(tmp, up.port), _env("e1", body=body), _env("e2", body=b"plain\r\n")
        )
    assert eight.outcome.kind is Kind.FAILED, eight.outcome
    assert eight.failover and not eight.outcome.data_sent
    reply = eight.outcome.reply
    assert reply is not None and (reply.code, reply.enhanced) == (554, "5.6.3"), reply
    assert "8BITMIME" in reply.text
    # Nothing of the 8-bit message reached the wire: not even its MAIL. The provider is
    # healthy, its connection clean: the 7-bit message after it went on the same one.
    assert seven.outcome.kind is Kind.DELIVERED, seven.outcome
    assert len(up.messages) == 1 and up.messages[0].endswith(b"plain")
    assert _mails(up) == [b"MAIL FROM:<billing@acme.example>"]
    assert up.connections == 1


async def test_an_8bit_message_declares_body_8bitmime_to_an_upstream_that_offers_it(tmp: Path) -> None:
    async with Scripted() as up:
        eight, seven = await _send_all(
            _provider(tmp, up.port), _env("e1", body=UTF8), _env("e2", body=b"plain\r\n")
        )
    assert eight.outcome.kind is Kind.DELIVERED and seven.outcome.kind is Kind.DELIVERED
    # The 8-bit message says so (RFC 6152 §3); a 7-bit one is sent as before, undeclared.
    assert _mails(up) == [
        b"MAIL FROM:<billing@acme.example> BODY=8BITMIME",
        b"MAIL FROM:<billing@acme.example>",
    ]
    assert UTF8.rstrip(b"\r\n") in up.messages[0]


async def test_an_8bit_submission_fails_over_to_the_provider_that_offers_8bitmime(tmp: Path) -> None:
    clock = FakeClock()
    async with Scripted(eightbitmime=False) as primary, Scripted() as standby:
        cfg = routed(tmp, smtp_provider("primary", primary.port), smtp_provider("standby", standby.port))
        async with running_guard(cfg, clock=clock) as guard:
            first = await send(guard.ports[0], _raw(KEY, UTF8))
            clock.t += 120
            again = await send(guard.ports[0], _raw(KEY, UTF8))
            assert guard.store is not None
            record = await guard.store.get("acme", KEY)
    assert first.code == 250, first
    assert again.code == 250 and "duplicate" in again.text, again
    assert record is not None and record.state == "delivered"
    # The primary saw no MAIL of it; the standby got it once, byte for byte, declared.
    assert _mails(primary) == [] and primary.messages == []
    assert len(standby.messages) == 1 and UTF8.rstrip(b"\r\n") in standby.messages[0]
    assert _mails(standby) == [b"MAIL FROM:<billing@acme.example> BODY=8BITMIME"]


async def test_an_8bit_submission_with_no_8bitmime_on_the_route_is_refused_and_stays_refused(
    tmp: Path,
) -> None:
    clock = FakeClock()
    async with Scripted(eightbitmime=False) as primary:
        cfg = routed(tmp, smtp_provider("primary", primary.port))
        async with running_guard(cfg, clock=clock) as guard:
            first = await send(guard.ports[0], _raw(KEY, LATIN1))
            clock.t += 120
            again = await send(guard.ports[0], _raw(KEY, LATIN1))
            seven = await send(guard.ports[0], _raw("invoice:7bit:1", b"plain\r\n"))
            assert guard.store is not None
            record = await guard.store.get("acme", KEY)
            usage = await cap_usage(guard)
    assert first.code == 554 and first.text.startswith("5.6.3") and "8BITMIME" in first.text, first
    # The event failed for good (a stored 5xx, until an operator releases it): no retry
    # writes it to the provider either.
    assert again.code == 554 and again.text.startswith("5.6.3"), again
    assert record is not None and record.state == "failed"
    assert seven.code == 250, seven
    # Refused before MAIL: its cap unit went back; only the 7-bit message spent one.
    assert usage == CapUsage(1, 1)
    assert len(primary.messages) == 1 and primary.messages[0].endswith(b"plain")
    assert _mails(primary) == [b"MAIL FROM:<billing@acme.example>"]


async def test_the_headers_smtpguard_adds_never_make_a_message_8bit(tmp: Path) -> None:
    # A key may hold non-ASCII letters; stripped from the message (ASCII then), it still
    # reaches the provider in its idempotency header, encoded (policy.events.tag_value):
    # the 7-bit message stays 7-bit and goes to a provider without 8BITMIME.
    env = Envelope("acme", "facture:é", "a-1", SENDER, (CUSTOMER,), b"Subject: s\r\n\r\nplain\r\n")
    async with Scripted(eightbitmime=False) as up:
        (result,) = await _send_all(_provider(tmp, up.port, idempotency_header="Resend-Idempotency-Key"), env)
    assert result.outcome.kind is Kind.DELIVERED, result.outcome
    assert len(up.messages) == 1 and up.messages[0].isascii()
    assert up.messages[0].startswith(f"Resend-Idempotency-Key: {tag_value('acme:facture:é')}\r\n".encode())
    assert _mails(up) == [b"MAIL FROM:<billing@acme.example>"]


async def test_a_standby_that_says_try_later_defers_the_8bit_event_instead_of_failing_it(tmp: Path) -> None:
    # The primary lacks 8BITMIME; the standby, which has it, answers MAIL with 451 once.
    # The event is deferred with the standby's reply, and its retry is delivered there.
    clock = FakeClock()
    async with (
        Scripted(eightbitmime=False) as primary,
        Scripted(mail=[b"451 4.3.0 try again later\r\n"]) as standby,
    ):
        cfg = routed(tmp, smtp_provider("primary", primary.port), smtp_provider("standby", standby.port))
        async with running_guard(cfg, clock=clock) as guard:
            first = await send(guard.ports[0], _raw(KEY, UTF8))
            clock.t += 120  # past min_retry_interval
            retry = await send(guard.ports[0], _raw(KEY, UTF8))
            assert guard.store is not None
            record = await guard.store.get("acme", KEY)
    assert first.code == 451 and first.text.startswith("4.3.0"), first
    assert retry.code == 250, retry
    assert record is not None and record.state == "delivered"
    assert primary.messages == [] and _mails(primary) == []
    assert len(standby.messages) == 1


async def test_postfix_smtp_sink_without_8bitmime_gets_nothing_and_the_standby_one_copy(tmp: Path) -> None:
    # The real peer: Postfix's smtp-sink with -8 (no 8BITMIME announced) as the primary,
    # a plain smtp-sink as the standby. Counted in their dumps.
    primary, standby = SmtpSink(tmp, "-8"), SmtpSink(tmp)
    primary.start()
    standby.start()
    try:
        cfg = routed(tmp, smtp_provider("primary", primary.port), smtp_provider("standby", standby.port))
        async with running_guard(cfg) as guard:
            eight = await send(guard.ports[0], _raw(KEY, UTF8))
            again = await send(guard.ports[0], _raw(KEY, UTF8))
            seven = await send(guard.ports[0], _raw("invoice:7bit:2", b"plain\r\n"))
    finally:
        primary.stop()
        standby.stop()
    try:
        assert eight.code == 250 and again.code == 250 and "duplicate" in again.text, (eight, again)
        assert seven.code == 250, seven
        assert primary.event_keys() == ["invoice:7bit:2"]
        assert standby.event_keys() == [KEY]
    finally:
        primary.cleanup()
        standby.cleanup()
