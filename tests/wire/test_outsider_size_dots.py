"""max_message_size against the message's own size (RFC 1870 §4: the octets of the message,
"not including the SMTP DATA command's terminating dot or doubled quoting dots").

A client that declared `SIZE=N` with N at or under the limit sends its message dot-stuffed
(RFC 5321 §4.5.2: every line that starts with a dot gets one more); those dots are the
transfer's, not the message's, and must not turn an accepted declaration into a 552.
Counted at the recording upstream: the message arrives once, its dot lines intact."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import message_bytes, session, terminated

pytestmark = pytest.mark.usefixtures("no_tracebacks")

LIMIT = 10_000


def _sized(key: str, size: int) -> bytes:
    """A message of exactly `size` octets (its final CRLF included) where most lines open
    with a dot: dot-stuffed, it is a tenth longer on the wire."""
    head = message_bytes(key, body=b"")
    line = b"." + b"d" * 8 + b"\r\n"  # 11 octets, 12 on the wire
    count, rest = divmod(size - len(head), len(line))
    body = line * count + (b"x" * (rest - 2) + b"\r\n" if rest >= 2 else b"")
    message = head + body
    assert len(message) == size - (rest if rest < 2 else 0)
    return message


@pytest.mark.parametrize("size", [LIMIT, LIMIT - 1])
async def test_a_message_at_the_limit_is_taken_however_many_dots_it_stuffs(
    tmp: Path, upstream: Upstream, size: int
) -> None:
    message = _sized(f"dots:{size}", size)
    wire = terminated(message)
    assert len(wire) - 3 > LIMIT  # over the limit as sent, at or under it as a message
    async with (
        running_guard(base_config(tmp, upstream.port, limits__max_message_size="10kB")) as guard,
        session(guard.ports[0]) as c,
    ):
        mail = await c.command(f"MAIL FROM:<billing@acme.example> SIZE={len(message)}")
        await c.command("RCPT TO:<customer@example.com>")
        reply = await c.data(wire)
    assert mail.code == 250, mail
    assert reply.code == 250, reply
    # As sent, with only the Message-ID smtpguard adds to a message that has none.
    (received,) = upstream.received
    added, _, rest = received.content.partition(b"\r\n")
    assert added.startswith(b"Message-ID: <sg.") and rest == message


async def test_one_octet_over_the_limit_is_still_552(tmp: Path, upstream: Upstream) -> None:
    message = _sized("dots:over", LIMIT) + b"y\r\n"
    async with (
        running_guard(base_config(tmp, upstream.port, limits__max_message_size="10kB")) as guard,
        session(guard.ports[0]) as c,
    ):
        await c.command("MAIL FROM:<billing@acme.example>")
        await c.command("RCPT TO:<customer@example.com>")
        reply = await c.data(terminated(message))
        assert guard.store is not None and await guard.store.get("acme", "dots:over") is None
    assert (reply.code, reply.enhanced) == (552, "5.3.4"), reply
    assert upstream.received == []
