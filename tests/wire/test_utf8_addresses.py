"""Non-ASCII envelope addresses (DESIGN.md §3, RFC 6531), end to end: a real client, the
in-process smtpguard, recording upstreams with and without SMTPUTF8, SQLite and Redis.

Without SMTPUTF8 on MAIL, or on a route whose providers do not offer it, such an address is
refused with 553 5.6.7 at the command that carries it, before anything is reserved; the
other recipients of the transaction go ahead. With SMTPUTF8 and a provider that offers it,
the message is relayed with SMTPUTF8.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from smtpguard.config import SmtpProviderConfig, loads
from smtpguard.policy.outcome import Kind
from smtpguard.relay import Envelope, SmtpProvider
from smtpguard.relay.wire import Answer, Session
from smtpguard.store import CapUsage
from tests.support import Upstream, base_config, running_guard
from tests.support.eventually import eventually
from tests.support.hostile import nothing_recorded
from tests.support.utf8 import Utf8Upstream, cap_usage, raw_message, store_overrides, transact, utf8_upstream

JOE = "jöe@example.net"
CUSTOMER = "customer@example.com"


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=6)


@pytest.fixture
async def utf8_up() -> AsyncIterator[Utf8Upstream]:
    async with utf8_upstream() as up:
        yield up


def _is_553_567(answer: object) -> bool:
    return str(answer).startswith("553 5.6.7 ")


async def test_non_ascii_recipient_without_smtputf8_is_refused_at_rcpt(
    tmp: Path, upstream: Upstream, store: dict[str, Any], no_tracebacks: None
) -> None:
    cfg = base_config(tmp, upstream.port, **store)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        # The customer is taken, jöe refused, the customer taken again after him.
        mixed = await transact(
            port, "billing@acme.example", [CUSTOMER, JOE, "b@example.com"], raw_message("u1")
        )
        alone = await transact(port, "billing@acme.example", [JOE], raw_message("u2"))
        usage = await cap_usage(guard)
        assert guard.store is not None
        record = await guard.store.get("acme", "u1")
        refused = await guard.store.get("acme", "u2")

    assert mixed.mail.code == 250
    assert [a.code for a in mixed.rcpts] == [250, 553, 250]
    assert _is_553_567(mixed.rcpts[1]) and "SMTPUTF8" in mixed.rcpts[1].text
    assert mixed.data is not None and mixed.data.code == 250 and "queued as Q1" in mixed.data.text
    # Only the accepted recipients reached the upstream, once.
    assert [r.rcpt_tos for r in upstream.received] == [[CUSTOMER, "b@example.com"]]
    assert upstream.handler.transactions == 1
    assert record is not None and record.state.value == "delivered"

    assert _is_553_567(alone.rcpts[0])
    assert alone.data is not None and alone.data.code == 503  # no recipient left: no DATA
    # The refused transaction reserved nothing and spent no unit; the relayed one spent one.
    assert refused is None and usage == CapUsage(1, 1)


async def test_non_ascii_sender_without_smtputf8_is_refused_at_mail(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        t = await transact(guard.ports[0], "jöe@notify.acme.example", [CUSTOMER], raw_message("u3"))
        untouched = await nothing_recorded(guard, "acme", "u3")
    assert _is_553_567(t.mail) and "sender" in t.mail.text
    assert t.rcpts == [] and t.data is None
    assert untouched and upstream.handler.transactions == 0


async def test_smtputf8_is_relayed_with_smtputf8_when_the_provider_offers_it(
    tmp: Path, utf8_up: Utf8Upstream, store: dict[str, Any], no_tracebacks: None
) -> None:
    cfg = base_config(tmp, utf8_up.port, **store)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        # The first message finds the provider's capability unknown (no connection yet): the
        # listener accepts and the relay checks the EHLO. The second finds it known.
        first = await transact(
            port,
            "jöe@notify.acme.example",
            [JOE],
            raw_message("u4", sender="jöe@notify.acme.example"),
            smtputf8=True,
        )
        second = await transact(
            port, "billing@acme.example", [CUSTOMER, "zoë@example.org"], raw_message("u5"), smtputf8=True
        )
        usage = await cap_usage(guard)

    for t in (first, second):
        assert t.mail.code == 250 and all(a.code == 250 for a in t.rcpts)
        assert t.data is not None and t.data.code == 250 and "[sg:" in t.data.text
    assert [(r.mail_from, r.rcpt_tos) for r in utf8_up.received] == [
        ("jöe@notify.acme.example", [JOE]),
        ("billing@acme.example", [CUSTOMER, "zoë@example.org"]),
    ]
    # Declared on MAIL to the provider both times (for the second, as the client declared it).
    # The first, whose header block is UTF-8, is 8-bit data too: BODY=8BITMIME (RFC 6152 §3).
    assert utf8_up.recorder.mail_options == [["SMTPUTF8", "BODY=8BITMIME"], ["SMTPUTF8"]]
    assert b"From: j\xc3\xb6e@notify.acme.example" in utf8_up.received[0].content
    assert usage == CapUsage(2, 2)


async def test_smtputf8_declared_with_ascii_addresses_is_relayed_with_smtputf8(
    tmp: Path, utf8_up: Utf8Upstream, store: dict[str, Any], no_tracebacks: None
) -> None:
    # RFC 6531: a client may declare SMTPUTF8 for UTF-8 header fields alone; the provider
    # must then be told too, or it may take the headers for raw 8-bit text.
    cfg = base_config(tmp, utf8_up.port, **store)
    async with running_guard(cfg) as guard:
        t = await transact(
            guard.ports[0], "billing@acme.example", [CUSTOMER], raw_message("u6"), smtputf8=True
        )
        plain = await transact(guard.ports[0], "billing@acme.example", [CUSTOMER], raw_message("u7"))
    assert t.data is not None and t.data.code == 250
    assert plain.data is not None and plain.data.code == 250
    assert utf8_up.recorder.mail_options == [["SMTPUTF8"], []]


async def test_smtputf8_refused_when_the_provider_does_not_offer_it(
    tmp: Path, upstream: Upstream, store: dict[str, Any], no_tracebacks: None
) -> None:
    cfg = base_config(tmp, upstream.port, **store)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        # Unknown capability: accepted at RCPT, refused by the relay on the provider's EHLO,
        # before MAIL went to it.
        first = await transact(port, "billing@acme.example", [JOE], raw_message("u6"), smtputf8=True)
        assert guard.store is not None and guard.route is not None
        record = await guard.store.get("acme", "u6")
        after_first = await cap_usage(guard)
        # Known now: the non-ASCII recipient is refused at RCPT (the route does not offer
        # SMTPUTF8); the ASCII sender is not, with or without the declaration.
        second = await transact(port, "billing@acme.example", [JOE], raw_message("u7"), smtputf8=True)
        refused = await guard.store.get("acme", "u7")
        after_second = await cap_usage(guard)
        # Without SMTPUTF8, a non-ASCII recipient is refused at RCPT; ASCII mail still flows
        # (the provider's circuit did not count the refusal as a failure).
        third = await transact(port, "billing@acme.example", [JOE, CUSTOMER], raw_message("u8"))
        circuits = guard.route.circuits()

    assert first.mail.code == 250 and [a.code for a in first.rcpts] == [250]
    assert first.data is not None and _is_553_567(first.data)
    assert "does not offer SMTPUTF8" in first.data.text and "[sg:" in first.data.text
    assert record is not None and record.state.value == "failed"
    assert [a.phase for a in record.attempts] == ["before_data"]
    assert after_first == CapUsage(0, 0)  # nothing reached DATA: the unit went back
    assert second.mail.code == 250 and len(second.rcpts) == 1
    assert _is_553_567(second.rcpts[0]) and "route does not offer SMTPUTF8" in second.rcpts[0].text
    assert second.data is not None and second.data.code == 503  # no recipient left
    # Refused before DATA: no record, no unit.
    assert refused is None and after_second == CapUsage(0, 0)
    assert [a.code for a in third.rcpts] == [553, 250]
    assert third.data is not None and third.data.code == 250
    # The provider saw one transaction in all: the third message's. No MAIL for jöe ever.
    assert upstream.handler.transactions == 1
    assert [r.rcpt_tos for r in upstream.received] == [[CUSTOMER]]
    assert {name: c.value for name, c in circuits.items()} == {"primary": "closed"}


async def test_failover_to_a_standby_that_offers_smtputf8(
    tmp: Path, upstream: Upstream, utf8_up: Utf8Upstream, no_tracebacks: None
) -> None:
    cfg = base_config(tmp, upstream.port)
    standby = dict(cfg["providers"][0], name="standby", port=utf8_up.port)
    cfg["providers"].append(standby)
    async with running_guard(cfg) as guard:
        replies = [
            await transact(guard.ports[0], "billing@acme.example", [JOE], raw_message(f"f{i}"), smtputf8=True)
            for i in range(2)
        ]
    for t in replies:
        assert t.data is not None and t.data.code == 250, t
    # The primary was never given MAIL for them; the standby took both, with SMTPUTF8.
    assert upstream.handler.transactions == 0
    assert [r.rcpt_tos for r in utf8_up.received] == [[JOE], [JOE]]
    assert utf8_up.recorder.mail_options == [["SMTPUTF8"], ["SMTPUTF8"]]


async def test_maildir_offers_smtputf8_from_the_first_message(tmp: Path, no_tracebacks: None) -> None:
    async with running_guard(base_config(tmp, None)) as guard:
        t = await transact(
            guard.ports[0],
            "jöe@notify.acme.example",
            [JOE],
            raw_message("m1", sender="jöe@notify.acme.example"),
            smtputf8=True,
        )
        usage = await cap_usage(guard)
    assert t.mail.code == 250 and [a.code for a in t.rcpts] == [250]
    assert t.data is not None and t.data.code == 250
    [written] = list((tmp / "maildir" / "new").iterdir())
    assert written.read_bytes().startswith("Return-Path: <jöe@notify.acme.example>\r\n".encode())
    assert usage == CapUsage(1, 1)


# --- the provider alone, against a real upstream: nothing unexpected escapes -----------------
def _provider(tmp: Path, port: int) -> SmtpProvider:
    provider = loads(yaml.safe_dump(base_config(tmp, port))).providers[0]
    assert isinstance(provider, SmtpProviderConfig)
    return SmtpProvider(provider, None, "guard.test")


async def _marked() -> None:
    return None


async def test_an_address_aiosmtplib_refuses_to_write_is_unavailable_not_unknown(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    provider = _provider(tmp, upstream.port)
    env = Envelope("acme", "k", "a1", "billing@acme.example", (CUSTOMER, "two words@example.com"), b"x\r\n")
    try:
        with caplog.at_level(logging.ERROR, "smtpguard.relay"):
            result = await provider.send(env, _marked)
    finally:
        await provider.close()
    # The second RCPT cannot be written (aiosmtplib's quoting raises ValueError), and every
    # line is made before one is written: nothing was sent, so another provider may be
    # tried and the cap unit refunded.
    assert result.outcome.kind is Kind.UNAVAILABLE and result.outcome.data_sent is False
    assert result.failover and result.health == "ok"
    assert "ValueError" in result.outcome.detail
    assert upstream.handler.transactions == 0 and upstream.received == []
    assert [r.getMessage() for r in caplog.records] == ["unexpected ValueError before DATA"]


async def test_an_address_that_cannot_be_encoded_is_unavailable_not_unknown(
    tmp: Path, utf8_up: Utf8Upstream
) -> None:
    provider = _provider(tmp, utf8_up.port)
    # A lone surrogate: what surrogateescape makes of bytes that are not UTF-8.
    env = Envelope("acme", "k", "a2", "billing@acme.example", ("j\udcc3e@example.net",), b"x\r\n")
    try:
        result = await provider.send(env, _marked)
        again = await provider.send(
            Envelope("acme", "k2", "a3", "billing@acme.example", (JOE,), b"x\r\n"), _marked
        )
    finally:
        await provider.close()
    assert result.outcome.kind is Kind.UNAVAILABLE and result.outcome.data_sent is False
    assert "UnicodeEncodeError" in result.outcome.detail
    # The connection that raised was dropped, not pooled half-way through a transaction.
    assert again.outcome.kind is Kind.DELIVERED and [r.rcpt_tos for r in utf8_up.received] == [[JOE]]
    assert provider.smtputf8 is True


async def test_an_unexpected_error_once_data_started_is_unknown(
    tmp: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_send, real_reply = Session.send, Session.reply
    written: list[bytes] = []

    def recorded(self: Session, data: bytes, replies: int = 1) -> list[asyncio.Future[Answer]]:
        written.append(data)
        return real_send(self, data, replies)

    async def dot_then_fail(self: Session, future: asyncio.Future[Answer], timeout: float) -> Answer:
        answer = await real_reply(self, future, timeout)
        if written[-1].endswith(b"\r\n.\r\n"):
            raise RuntimeError("defect after the dot")
        return answer

    monkeypatch.setattr(Session, "send", recorded)
    monkeypatch.setattr(Session, "reply", dot_then_fail)
    provider = _provider(tmp, upstream.port)
    env = Envelope("acme", "k", "a4", "billing@acme.example", (CUSTOMER,), b"Subject: x\r\n\r\nx\r\n")
    try:
        result = await provider.send(env, _marked)
    finally:
        await provider.close()
    # The upstream has the message: the outcome is unknown, never retried elsewhere.
    assert len(upstream.received) == 1
    assert result.outcome.kind is Kind.UNKNOWN and result.outcome.data_sent is True
    assert not result.failover and "RuntimeError" in result.outcome.detail


async def test_a_declaration_the_message_does_not_need_is_dropped_for_a_provider_without_it(
    tmp: Path, upstream: Upstream, store: dict[str, Any], no_tracebacks: None
) -> None:
    """As Postfix does: all-ASCII addresses and headers travel without SMTPUTF8; UTF-8 header
    fields (RFC 6532) cannot, and are refused before anything is sent."""
    cfg = base_config(tmp, upstream.port, **store)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        ascii_only = await transact(
            port, "billing@acme.example", [CUSTOMER], raw_message("d1"), smtputf8=True
        )
        utf8_head = raw_message("d2").replace(b"Subject: Invoice", "Subject: Facture réglée".encode())
        needs_it = await transact(port, "billing@acme.example", [CUSTOMER], utf8_head, smtputf8=True)
        usage = await cap_usage(guard)
    assert ascii_only.data is not None and ascii_only.data.code == 250
    assert needs_it.data is not None and _is_553_567(needs_it.data)
    assert [r.header("X-Event-Key") for r in upstream.received] == ["d1"]
    assert upstream.handler.transactions == 1 and usage == CapUsage(1, 1)


async def test_a_capability_refusal_stays_retryable_while_the_capable_standby_is_down(
    tmp: Path, upstream: Upstream, no_tracebacks: None
) -> None:
    from tests.support import free_port

    cfg = base_config(tmp, upstream.port, zones__acme__delivery="queue")
    cfg["providers"].append(dict(cfg["providers"][0], name="standby", port=free_port()))  # nothing listens
    async with running_guard(cfg) as guard:
        t = await transact(guard.ports[0], "billing@acme.example", [JOE], raw_message("q1"), smtputf8=True)
        assert guard.store is not None
        rec = await eventually(
            lambda: guard.store.get("acme", "q1"),
            lambda r: r is not None and r.attempts,
            timeout=5,
            interval=0.05,
        )
    assert t.data is not None and t.data.code == 250 and "queued" in t.data.text
    assert rec is not None and rec.state.value == "deferred", rec.state
    assert upstream.handler.transactions == 0
