"""A message forwarded as an attachment (message/rfc822 holding a multipart) is one event
however its client draws the boundaries: the embedded message's header block declares a
boundary as a part's header does, and the email package draws both afresh per attempt."""

from __future__ import annotations

from email.message import EmailMessage
from pathlib import Path

import pytest

from smtpguard.policy import fingerprint as fp_module
from tests.policy.test_fingerprint import _v1_neutral_boundaries, fp, msg, raw
from tests.support import Upstream, base_config, message, running_guard, send


def forwarded(key: str | None) -> EmailMessage:
    inner = EmailMessage()
    inner["From"] = "ann@example.org"
    inner["To"] = "billing@acme.example"
    inner["Subject"] = "Question about invoice 1044"
    inner.set_content("Hello,\nwhy is it due today?\n")
    inner.add_alternative("<p>Hello,<br>why is it due today?</p>\n", subtype="html")
    outer = message(key, subject="Fwd: Question about invoice 1044", body="See the forwarded mail.\n")
    outer.add_attachment(inner)
    return outer


def wire(m: EmailMessage) -> bytes:
    return m.as_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")


def test_forwarded_message_hashes_as_before_and_is_one_message() -> None:
    first, retry = wire(forwarded("k")), wire(forwarded("k"))
    assert first != retry  # fresh boundaries, outer and embedded
    assert fp(first) == fp(retry)
    m = msg(first)
    assert fp_module._neutral_boundaries(m.header_block, m.body) == _v1_neutral_boundaries(
        m.header_block, m.body
    )


async def test_derived_key_retry_of_a_forwarded_message_is_sent_once(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port)
    cfg["zones"]["acme"]["missing_key"] = "derive"
    async with running_guard(cfg) as guard:
        replies = [await send(guard.ports[0], wire(forwarded(None))) for _ in range(2)]
    assert [r.code for r in replies] == [250, 250] and "duplicate" in replies[1].text
    assert len(upstream.received) == 1


async def test_keyed_retry_of_a_forwarded_message_is_a_duplicate(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        replies = [await send(guard.ports[0], wire(forwarded("fwd:1044"))) for _ in range(2)]
    assert [r.code for r in replies] == [250, 250] and "duplicate" in replies[1].text, replies
    assert upstream.event_keys() == ["fwd:1044"]


def test_a_message_that_is_a_message_is_neutral_inside_too() -> None:
    def whole(b: bytes) -> bytes:
        return (
            b"From: Billing <billing@acme.example>\r\nTo: ann@example.org\r\nSubject: Fwd\r\n"
            b"MIME-Version: 1.0\r\nContent-Type: message/rfc822\r\n\r\n"
            b'From: ann@example.org\r\nContent-Type: multipart/alternative; boundary="' + b + b'"\r\n\r\n'
            b"--" + b + b"\r\nContent-Type: text/plain\r\n\r\nHi\r\n--" + b + b"--\r\n"
        )

    assert fp(whole(b"x1")) == fp(whole(b"y2"))
    # A plain embedded message keeps its text: `boundary=` there is content.
    plain = b"From: Billing <billing@acme.example>\r\nContent-Type: message/rfc822\r\n\r\nFrom: a@b\r\n\r\n"
    assert fp(plain + b"?boundary=1\r\n") != fp(plain + b"?boundary=2\r\n")


def _nested(outer: bytes, inner: bytes, parameter: bytes, blank: bool = True) -> bytes:
    part_header = b"Content-Type: multipart/alternative;" + parameter.replace(b"B", inner) + b"\r\n"
    return raw(
        extra=b'MIME-Version: 1.0\r\nContent-Type: multipart/mixed;\r\n\tboundary="' + outer + b'"\r\n',
        body=b"--"
        + outer
        + b"\r\n"
        + part_header
        + (b"\r\n" if blank else b"")
        + b"--"
        + inner
        + b"\r\nContent-Type: text/plain\r\n\r\nHi\r\n--"
        + inner
        + b"--\r\n"
        + b"--"
        + outer
        + b"--\r\n",
    )


@pytest.mark.parametrize(
    ("parameter", "blank"),
    [
        pytest.param(b'\r\n boundary=\r\n "B"', True, id="folded-after-equals"),
        pytest.param(b'\r\n\tboundary="B"', False, id="no-blank-line"),
        pytest.param(b" boundary = B", True, id="spaced-unquoted"),
    ],
)
def test_a_part_headers_boundary_is_neutral_however_folded(parameter: bytes, blank: bool) -> None:
    first, retry = _nested(b"o1", b"i1", parameter, blank), _nested(b"o2", b"i2", parameter, blank)
    assert fp(first) == fp(retry)
    m = msg(first)
    assert fp_module._neutral_boundaries(m.header_block, m.body) == _v1_neutral_boundaries(
        m.header_block, m.body
    )


def test_the_earlier_fingerprint_is_given_only_where_the_rules_differ() -> None:
    from smtpguard.policy.fingerprint import earlier_fingerprint

    plain = msg(raw(body=b"Pay at https://pay.example/?boundary=77\r\n"))
    before = earlier_fingerprint("billing@acme.example", ["ann@example.org"], plain)
    now = fp_module.fingerprint("billing@acme.example", ["ann@example.org"], plain)
    assert before is not None and before != now
    built = msg(wire(forwarded("k")))
    assert earlier_fingerprint("billing@acme.example", ["ann@example.org"], built) is None
    assert earlier_fingerprint("billing@acme.example", ["ann@example.org"], msg(raw())) is None
