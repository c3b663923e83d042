"""A key with non-ASCII letters and a provider's `idempotency_header` (DESIGN.md §6, §18).

The key may be any printable text (`facture:é`, `注文:1`); the header smtpguard adds for the
provider is smtpguard's own, and it must be a field any SMTP server may take: RFC 6532 allows
raw UTF-8 in a header field only in a transaction that declared SMTPUTF8 (RFC 6531), and
8BITMIME covers the body, not the header. So a key that cannot be written in ASCII is
written encoded (the `~b64:` form every smtpguard tag uses, policy.events.tag_value), the
same on every attempt, whatever the connection offers: the provider dedupes on equal
values. Counted at a real recording upstream (aiosmtpd: 8BITMIME, no SMTPUTF8) and at a
scripted one without 8BITMIME, whose MAIL lines are read as written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from smtpguard.policy.events import key_of_tag
from tests.relay.test_resilience import routed, smtp_provider
from tests.relay.test_wire_attacks import Scripted
from tests.support import FakeClock, Received, Upstream, base_config, running_guard, send

pytestmark = pytest.mark.usefixtures("no_tracebacks")

HEADER = "Resend-Idempotency-Key"
KEYS = ["facture:é", "注文:2026:1", "k" * 150 + "ü"]


def _raw(key: str) -> bytes:
    # A 7-bit message but for the key header (stripped before relay: event_key.strip).
    return (
        b"From: billing@acme.example\r\nTo: customer@example.com\r\nSubject: s\r\n"
        + f"X-Event-Key: {key}\r\n\r\nplain text\r\n".encode()
    )


def _idempotency_fields(content: bytes) -> list[bytes]:
    head = content.split(b"\r\n\r\n", 1)[0]
    return [f for f in head.split(b"\r\n") if f.lower().startswith(HEADER.lower().encode() + b":")]


async def _sent_and_retried(tmp: Path, upstream: Upstream, key: str) -> Received:
    """The message with `key` sent, then again two minutes on: the second is a duplicate,
    and the one message the upstream received is returned."""
    cfg = base_config(tmp, upstream.port)
    cfg["event_key"].pop("strip")  # on, as by default: only smtpguard's header carries the key
    cfg["providers"][0]["idempotency_header"] = HEADER
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        first = await send(guard.ports[0], _raw(key))
        clock.t += 120
        again = await send(guard.ports[0], _raw(key))
    assert first.code == 250, first
    assert again.code == 250 and "duplicate" in again.text, again
    (received,) = upstream.received
    return received


@pytest.mark.parametrize("key", KEYS, ids=["latin", "cjk", "long"])
async def test_a_non_ascii_key_reaches_a_provider_without_smtputf8_as_an_ascii_header(
    tmp: Path, upstream: Upstream, key: str
) -> None:
    received = await _sent_and_retried(tmp, upstream, key)
    # No 8-bit octet in the header block the provider got (it offered no SMTPUTF8).
    assert received.content.split(b"\r\n\r\n", 1)[0].isascii(), received.content[:300]
    (field,) = _idempotency_fields(received.content)
    value = field.split(b":", 1)[1].strip().decode("ascii")
    assert key_of_tag(value) == f"acme:{key}"


async def test_an_ascii_message_with_a_non_ascii_key_is_sent_to_a_provider_without_8bitmime(
    tmp: Path,
) -> None:
    # The client's message is 7-bit; only the key has non-ASCII letters. Before, the header
    # smtpguard added made it 8-bit, and the event failed for good (554 5.6.3) on a
    # provider that offers no 8BITMIME.
    async with Scripted(eightbitmime=False) as up:
        cfg = routed(tmp, smtp_provider("primary", up.port, idempotency_header=HEADER))
        cfg["event_key"].pop("strip")
        async with running_guard(cfg) as guard:
            reply = await send(guard.ports[0], _raw("facture:é"))
            assert guard.store is not None
            record = await guard.store.get("acme", "facture:é")
    assert reply.code == 250, reply
    assert record is not None and record.state == "delivered"
    assert len(up.messages) == 1 and up.messages[0].isascii()
    mails = [c for c in up.commands if c.upper().startswith(b"MAIL")]
    assert mails == [b"MAIL FROM:<billing@acme.example>"]


async def test_a_key_too_long_to_encode_on_one_line_is_written_as_its_digest(
    tmp: Path, upstream: Upstream
) -> None:
    # 200 characters of four UTF-8 octets each: a valid key, whose base64 would make a
    # header line over RFC 5322's 998 octets (a provider may refuse such a message).
    key = "\U0001f389" * 200
    received = await _sent_and_retried(tmp, upstream, key)
    assert all(len(line) <= 998 for line in received.content.split(b"\r\n"))
    (field,) = _idempotency_fields(received.content)
    digest = hashlib.sha256(f"acme:{key}".encode()).hexdigest()
    assert field == f"{HEADER}: ~sha256:{digest}".encode()


async def test_an_ascii_key_is_written_as_it_was(tmp: Path, upstream: Upstream) -> None:
    # Unchanged for every key that ASCII can carry: an event retried across an upgrade
    # keeps the value the provider dedupes on.
    cfg = base_config(tmp, upstream.port)
    cfg["providers"][0]["idempotency_header"] = HEADER
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], _raw("invoice:acme:1044"))
    assert reply.code == 250, reply
    assert _idempotency_fields(upstream.received[0].content) == [f"{HEADER}: acme:invoice:acme:1044".encode()]
