"""Malformed messages over a real socket: a clear 5xx, nothing relayed, no ledger record, no
traceback in the logs."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import nothing_recorded, submit

# Every hostile case must leave no traceback in the logs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_tracebacks")


FROM = b"From: billing@acme.example"
TAIL = b"To: customer@example.com\r\nSubject: hi\r\n\r\nbody\r\n"
KEY = b"X-Event-Key: bad:1"
B64_BILLING = base64.b64encode(b"billing@acme.example")


def msg(*headers: bytes) -> bytes:
    return b"\r\n".join(headers) + b"\r\n" + TAIL


MALFORMED = [
    pytest.param(
        msg(FROM, KEY, b"Subject: \xff\xfe broken"), 550, "5.6.0", "UTF-8", id="invalid-utf8-header"
    ),
    pytest.param(
        msg(b"From: Caf\xe9 <billing@acme.example>", KEY), 550, "5.6.0", "UTF-8", id="latin1-8bit-from"
    ),
    pytest.param(msg(FROM, b"X-Event-Key: bad:1", b" :folded"), 550, "5.6.0", "whitespace", id="folded-key"),
    pytest.param(msg(FROM, KEY, KEY), 550, "5.6.0", "more than once", id="duplicated-key"),
    pytest.param(
        msg(FROM, KEY, b"x-event-KEY: bad:2"), 550, "5.6.0", "more than once", id="duplicated-key-other-case"
    ),
    pytest.param(msg(FROM, b"X-Event-Key: " + b"k" * 201), 550, "5.6.0", "longer than", id="key-too-long"),
    pytest.param(msg(FROM, b"X-Event-Key: bad\x01key"), 550, "5.6.0", "control", id="key-control-char"),
    pytest.param(msg(FROM, b"X-Event-Key:"), 550, "5.6.0", "empty", id="key-empty"),
    pytest.param(msg(KEY), 550, "5.6.0", "no From", id="missing-from"),
    pytest.param(
        msg(FROM, KEY, b"From: billing@acme.example"),
        550,
        "5.6.0",
        "more than one From",
        id="two-from-headers",
    ),
    pytest.param(
        msg(b"From: billing@acme.example, info@notify.acme.example", KEY),
        550,
        "5.6.0",
        "exactly one",
        id="two-from-addresses",
    ),
    pytest.param(
        msg(b"From: =?utf-8?b?" + B64_BILLING + b"?= <evil@attacker.example>", KEY),
        550,
        "5.7.1",
        "evil@attacker.example",
        id="encoded-word-display-name",
    ),
    pytest.param(
        msg(b"From: =?utf-8?b?" + B64_BILLING + b"?=", KEY),
        550,
        "5.6.0",
        "exactly one",
        id="encoded-word-alone",
    ),
    pytest.param(
        msg(b"From: billing@acme.example <evil@attacker.example>", KEY),
        550,
        "5.6.0",
        "exactly one",
        id="address-as-display-name",
    ),
    pytest.param(
        msg(b'From: "billing@acme.example" <evil@attacker.example>', KEY),
        550,
        "5.7.1",
        "evil@attacker.example",
        id="quoted-address-as-display-name",
    ),
    pytest.param(
        msg(b"From: evil@attacker.example (billing@acme.example)", KEY),
        550,
        "5.6.0",
        "exactly one",
        id="comment",
    ),
    pytest.param(
        msg(b"From: <billing@acme.example> <evil@attacker.example>", KEY),
        550,
        "5.6.0",
        "exactly one",
        id="two-angles",
    ),
    pytest.param(msg(b"From: undisclosed-senders:;", KEY), 550, "5.6.0", "exactly one", id="group"),
    pytest.param(
        msg(b"From: billing@acme.example@attacker.example", KEY), 550, "5.6.0", "exactly one", id="two-ats"
    ),
    pytest.param(
        msg(b"From: billing%attacker.example@acme.example", KEY), 550, "5.6.0", "exactly one", id="percent"
    ),
    pytest.param(msg(b"From:", KEY), 550, "5.6.0", "exactly one", id="empty-from"),
    pytest.param(
        msg(FROM, KEY, b"Subject: " + b"s" * 5000), 500, "5.5.2", "too long", id="absurdly-long-header-line"
    ),
    pytest.param(msg(FROM, KEY, b"no colon here"), 550, "5.6.0", "field name", id="header-without-colon"),
    pytest.param(
        msg(b" continuation first", FROM, KEY), 550, "5.6.0", "continuation", id="leading-continuation"
    ),
    pytest.param(msg(FROM, KEY, b"Bad Name: x"), 550, "5.6.0", "field name", id="space-in-field-name"),
    pytest.param(b"\r\nbody only\r\n", 550, "5.6.0", "no header block", id="no-header-block"),
    pytest.param(b"", 550, "5.6.0", "no header block", id="empty-message"),
]


@pytest.mark.parametrize(("message", "code", "enhanced", "says"), MALFORMED)
async def test_malformed_message_gets_a_clear_5xx_and_nothing_is_sent(
    tmp: Path, upstream: Upstream, message: bytes, code: int, enhanced: str, says: str
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        reply = await submit(guard.ports[0], message)
        for key in ("bad:1", "bad:2"):
            assert await nothing_recorded(guard, "acme", key)
        # The server is still serving.
        ok = await submit(guard.ports[0], msg(FROM, b"X-Event-Key: good:1"))
    assert (reply.code, reply.enhanced) == (code, enhanced), reply
    assert says in reply.text, reply
    assert ok.code == 250, ok
    assert [r.header("X-Event-Key") for r in upstream.received] == ["good:1"]


@pytest.mark.parametrize(
    "from_header",
    [
        pytest.param(b"From: Acme Billing <billing@acme.example>", id="display-name"),
        pytest.param(b'From: "Acme, Billing" <billing@acme.example>', id="quoted-display-name"),
        pytest.param(b"From: =?utf-8?q?Acme_B=C3=BCro?= <billing@acme.example>", id="encoded-word-name"),
        pytest.param("From: Acme Büro <billing@acme.example>".encode(), id="utf8-name"),
        pytest.param(b"From: billing@acme.example (Acme Billing)", id="trailing-comment"),
        pytest.param(b"From: <alerts@notify.acme.example>", id="domain-alias"),
        pytest.param(b"From:\r\n Acme <billing@acme.example>", id="folded"),
    ],
)
async def test_well_formed_from_headers_are_sent(tmp: Path, upstream: Upstream, from_header: bytes) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        reply = await submit(guard.ports[0], msg(from_header, b"X-Event-Key: ok:1"))
    assert reply.code == 250, reply
    assert len(upstream.received) == 1
