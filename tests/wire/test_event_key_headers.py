"""Key header aliases and stripping (DESIGN.md §16): `event_key.header` as a list, the first
present wins, two different values 550 5.6.0; `event_key.strip` removes every key header
before relay, byte-exactly, and a provider's idempotency_header still carries ZONE:KEY.
Counted at a real recording upstream, submitted by a real SMTP client."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml

from smtpguard.config import ConfigError, loads
from smtpguard.policy.strip import without_headers
from tests.queue.test_queue import queue_config
from tests.support import Upstream, base_config, free_port, running_guard, send, settled_records

ALIASES = ["X-Event-Key", "Idempotency-Key"]


def raw(*head: str, body: bytes = b"Your invoice.\r\nX-Event-Key: a body line, not a header\r\n") -> bytes:
    lines = ["From: billing@acme.example", "To: customer@example.com", "Subject: Invoice 1", *head]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def stripping(cfg: dict[str, Any], **event_key: Any) -> dict[str, Any]:
    # tests/support turns stripping off so that other tests can count by header: back on.
    cfg["event_key"].pop("strip")
    cfg["event_key"].update(event_key)
    return cfg


def heads(content: bytes) -> bytes:
    return content.split(b"\r\n\r\n", 1)[0]


# --- the pure cut ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(
            b"A: 1\r\nX-Event-Key: k\r\nB: 2\r\n\r\nbody\r\n", b"A: 1\r\nB: 2\r\n\r\nbody\r\n", id="middle"
        ),
        pytest.param(b"x-event-key: k\r\nB: 2\r\n\r\nb\r\n", b"B: 2\r\n\r\nb\r\n", id="first-any-case"),
        pytest.param(
            b"A: 1\r\nX-Event-Key:\r\n folded\r\n\tmore\r\nB: 2\r\n folded b\r\n\r\nx\r\n",
            b"A: 1\r\nB: 2\r\n folded b\r\n\r\nx\r\n",
            id="folded-continuations-go-with-it",
        ),
        pytest.param(b"A: 1\r\nX-Event-Key: k\r\n", b"A: 1\r\n", id="no-body"),
        pytest.param(
            b"A: 1\r\nX-Event-Keys: k\r\nX-Event-Key-2: k\r\n\r\nX-Event-Key: in body\r\n",
            b"A: 1\r\nX-Event-Keys: k\r\nX-Event-Key-2: k\r\n\r\nX-Event-Key: in body\r\n",
            id="longer-names-and-body-kept",
        ),
        pytest.param(
            b"A: 1\r\nIdempotency-Key: i\r\nX-Event-Key: k\r\n\r\n\r\n\r\nbody\r\n",
            b"A: 1\r\n\r\n\r\n\r\nbody\r\n",
            id="both-aliases-blank-body-lines-kept",
        ),
    ],
)
def test_without_headers_cuts_whole_fields_only(data: bytes, expected: bytes) -> None:
    assert without_headers(data, ALIASES) == expected


def test_without_headers_joins_the_prefix_in_the_same_copy() -> None:
    cut = b"A: 1\r\nX-Event-Key: k\r\n\r\nbody\r\n"
    kept = b"A: 1\r\n\r\nbody\r\n"
    prefix = b"Message-ID: <p@x>\r\n"
    assert without_headers(cut, ALIASES, prefix) == prefix + kept
    assert without_headers(kept, ALIASES, prefix) == prefix + kept
    assert without_headers(kept, ALIASES, b"") is kept


def test_without_headers_leaves_a_message_without_them_untouched() -> None:
    data = b"A: 1\r\nB: 2\r\n\r\nX-Event-Key: body\r\n"
    assert without_headers(data, ALIASES) is data


# --- end to end ------------------------------------------------------------------------------
@pytest.mark.parametrize("delivery", ["relay", "queue"])
async def test_key_header_is_stripped_before_relay_byte_exactly(
    tmp: Path, upstream: Upstream, delivery: str
) -> None:
    cfg = base_config(tmp, upstream.port) if delivery == "relay" else queue_config(tmp, upstream.port)
    stripping(cfg)
    sent = raw("X-Event-Key:\r\n strip:1", "Message-ID: <m1@acme.example>", "X-Trace: a\r\n\tb")
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], sent)
        assert reply.code == 250, reply
        await upstream.wait_received(1)
        if delivery == "queue":
            records = await settled_records(cfg["store"]["url"], "acme", ["strip:1"])
            assert records["strip:1"].state.value == "delivered"
    assert len(upstream.received) == 1
    got = upstream.received[0].content
    assert b"x-event-key" not in heads(got).lower() and b" strip:1" not in got
    # Everything else as sent, byte for byte (the body's look-alike line included).
    expected = raw("Message-ID: <m1@acme.example>", "X-Trace: a\r\n\tb")
    assert got == expected


async def test_the_queue_stores_the_message_already_stripped(tmp: Path) -> None:
    # Nothing listens upstream: the message waits in the store (a real SQLite file), where
    # it must already be without the key header.
    cfg = stripping(queue_config(tmp, free_port()))
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], raw("X-Event-Key: stored:1", "Message-ID: <s1@acme.example>"))
        assert reply.code == 250 and "queued" in reply.text, reply
        assert guard.store is not None
        assert len(await guard.store.queue_entries("acme")) == 1
    with sqlite3.connect(tmp / "state.db") as db:
        contents = [bytes(row[0]) for row in db.execute("SELECT content FROM queue")]
    assert len(contents) == 1
    assert b"<s1@acme.example>" in contents[0] and b"X-Event-Key" not in heads(contents[0])


async def test_idempotency_header_still_carries_zone_and_key(tmp: Path, upstream: Upstream) -> None:
    cfg = stripping(base_config(tmp, upstream.port), header=ALIASES)
    cfg["providers"][0]["idempotency_header"] = "X-Provider-Idempotency"
    async with running_guard(cfg) as guard:
        first = await send(guard.ports[0], raw("Idempotency-Key: order-7"))
    assert first.code == 250, first
    assert len(upstream.received) == 1
    got = upstream.received[0]
    assert got.header("X-Provider-Idempotency") == "acme:order-7"
    assert got.header("Idempotency-Key") is None and got.header("X-Event-Key") is None


async def test_strip_false_lets_the_key_header_travel(tmp: Path, upstream: Upstream) -> None:
    cfg = stripping(base_config(tmp, upstream.port), strip=False)
    sent = raw("X-Event-Key: keep:1", "Message-ID: <k1@acme.example>")
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], sent)).code == 250
    assert [r.content for r in upstream.received] == [sent]


async def test_alias_header_alone_works_and_dedupes_against_the_first(tmp: Path, upstream: Upstream) -> None:
    cfg = stripping(base_config(tmp, upstream.port), header=ALIASES)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        alone = await send(port, raw("Idempotency-Key: pay:42"))
        # The same event later keyed by the first header: a duplicate, nothing sent.
        later = await send(port, raw("X-Event-Key: pay:42"))
        both_same = await send(port, raw("X-Event-Key: pay:42", "Idempotency-Key: pay:42"))
        differ = await send(port, raw("X-Event-Key: pay:43", "Idempotency-Key: pay:44"))
        twice = await send(port, raw("Idempotency-Key: pay:45", "Idempotency-Key: pay:45"))
        neither = await send(port, raw())
    assert alone.code == 250 and "duplicate" not in alone.text, alone
    assert later.code == 250 and "duplicate" in later.text, later
    assert both_same.code == 250 and "duplicate" in both_same.text, both_same
    assert differ.code == 550 and differ.text.startswith("5.6.0"), differ
    assert "X-Event-Key" in differ.text and "Idempotency-Key" in differ.text
    assert twice.code == 550 and twice.text.startswith("5.6.0") and "Idempotency-Key" in twice.text, twice
    assert neither.code == 550 and neither.text.startswith("5.7.0"), neither
    assert "X-Event-Key or Idempotency-Key" in neither.text
    # One event reached the upstream, once; the refused ones not at all.
    assert len(upstream.received) == 1 and upstream.handler.transactions == 1


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        pytest.param([], "at least one header", id="empty-list"),
        pytest.param(["X-Event-Key", "x-event-key"], "the same header twice", id="repeated-any-case"),
        pytest.param(["X-Event-Key", "Idempotency Key"], "not a header field name", id="space"),
        pytest.param("X-Event-Key:", "not a header field name", id="colon"),
    ],
)
def test_header_list_config_errors(tmp: Path, header: object, problem: str) -> None:
    cfg = base_config(tmp, 2525)
    cfg["event_key"]["header"] = header
    with pytest.raises(ConfigError) as e:
        loads(yaml.safe_dump(cfg))
    text = "\n".join(e.value.problems)
    assert "event_key.header" in text and problem in text, text


@pytest.mark.parametrize("name", ["Message-ID", "from", "Subject", "Content-Type", "DKIM-Signature"])
def test_strip_refuses_a_key_header_the_message_itself_needs(tmp: Path, name: str) -> None:
    # `header: Message-ID` (a natural idempotency key) loaded before strip existed; with
    # strip on by default it would silently relay every message without its Message-ID
    # (From, Subject, Content-Type: a broken message). A clear config error instead.
    cfg = stripping(base_config(tmp, 2525), header=["X-Event-Key", name])
    with pytest.raises(ConfigError) as e:
        loads(yaml.safe_dump(cfg))
    text = "\n".join(e.value.problems)
    assert "event_key.header" in text and name in text and "strip" in text, text
    # Kept in the message (strip: false), such a header may name the event.
    cfg["event_key"]["strip"] = False
    assert loads(yaml.safe_dump(cfg)).event_key.headers == ("X-Event-Key", name)


@pytest.mark.parametrize("strip", [True, False])
async def test_the_provider_gets_one_idempotency_header_and_it_is_ours(
    tmp: Path, upstream: Upstream, strip: bool
) -> None:
    # A client's own field of the provider's idempotency_header name must not travel next
    # to smtpguard's: a provider deduplicating on it would take the client's value, and one
    # zone could name another zone's event (`globex:…`) and have that one dropped as a
    # duplicate. With strip off and the header also a key alias, the client's copy is the
    # key unqualified: the provider must still see ZONE:KEY alone.
    cfg = stripping(base_config(tmp, upstream.port), header=ALIASES, strip=strip)
    cfg["providers"][0]["idempotency_header"] = "Idempotency-Key"
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        aliased = await send(port, raw("Idempotency-Key: order-8"))
        forged = await send(port, raw("X-Event-Key: order-9", "idempotency-key:\r\n globex:order-1"))
    assert aliased.code == 250, aliased
    assert forged.code == 550 and forged.text.startswith("5.6.0"), forged
    cfg["event_key"]["header"] = "X-Event-Key"
    async with running_guard(cfg) as guard:
        alone = await send(guard.ports[0], raw("X-Event-Key: order-10", "Idempotency-Key: globex:order-1"))
    assert alone.code == 250, alone
    assert len(upstream.received) == 2
    fields = [
        [line for line in heads(r.content).split(b"\r\n") if line.lower().startswith(b"idempotency-key:")]
        for r in upstream.received
    ]
    assert fields == [[b"Idempotency-Key: acme:order-8"], [b"Idempotency-Key: acme:order-10"]], fields
    assert b"globex:order-1" not in upstream.received[1].content


async def test_a_long_key_folded_by_the_mail_library_is_one_event(tmp: Path, upstream: Upstream) -> None:
    # Python's email package writes a key too long for a line of its own (past about 77
    # characters) as folded RFC 2047 encoded-words: the application's key, not one with
    # whitespace in it.
    from email.message import EmailMessage

    key = "invoice:acme-corporation-international:2026-12-04:customer-000123456789:line-items-v2"
    m = EmailMessage()
    m["From"], m["To"], m["Subject"], m["X-Event-Key"] = "billing@acme.example", "c@example.com", "s", key
    m.set_content("Your invoice.\n")
    assert b"=?utf-8?q?" in m.as_bytes()
    cfg = stripping(base_config(tmp, upstream.port))
    cfg["providers"][0]["idempotency_header"] = "Resend-Idempotency-Key"
    async with running_guard(cfg) as guard:
        first = await send(guard.ports[0], m)
        again = await send(guard.ports[0], m)
        assert guard.store is not None
        record = await guard.store.get("acme", key)
    assert first.code == 250 and again.code == 250 and "duplicate" in again.text, (first, again)
    assert record is not None and record.state == "delivered"
    assert len(upstream.received) == 1
    # The provider's idempotency header carries the decoded key; the folded header is gone.
    assert upstream.received[0].header("Resend-Idempotency-Key") == f"acme:{key}"
    assert b"X-Event-Key" not in heads(upstream.received[0].content)
