"""The DATA transfer as smtpguard reads it: in chunks up to each ".\\r\\n", not line by line.

Every case goes through a real listener to the recording upstream and compares the bytes the
upstream received with the message the client meant, however the client's bytes were cut
into TCP segments."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import RawClient, message_bytes, session, terminated

pytestmark = pytest.mark.usefixtures("no_tracebacks")

LINE_LIMIT = 1000

# Lines that look like the end of data, or like stuffing, without being either.
TRICKY_BODY = (
    b".\r\n"
    b"..\r\n"
    b".leading dot\r\n"
    b"...three\r\n"
    b"a sentence that ends with a dot.\r\n"
    b"x.\r\n"
    b" .\r\n"
    b"\r\n"
    b".\r\n"
    b"last line.\r\n"
)


def body_of(content: bytes) -> bytes:
    return content.split(b"\r\n\r\n", 1)[1]


async def send_cut(client: RawClient, data: bytes, cuts: list[int]) -> None:
    """Write `data` in segments ending at each offset of `cuts`, letting each one arrive."""
    start = 0
    for end in [*cuts, len(data)]:
        if end <= start:
            continue
        client.write(data[start:end])
        await client.writer.drain()
        await asyncio.sleep(0.002)
        start = end


async def transfer(port: int, data: bytes, cuts: list[int]) -> tuple[int, str]:
    async with session(port) as c:
        assert (await c.command("MAIL FROM:<billing@acme.example>")).code == 250
        assert (await c.command("RCPT TO:<customer@example.com>")).code == 250
        assert (await c.command("DATA")).code == 354
        await send_cut(c, data, cuts)
        reply = await c.reply()
        # The session goes on after the transfer, whatever its outcome.
        assert (await c.command("NOOP")).code == 250
        return reply.code, reply.enhanced


def cuts_for(mode: str, data: bytes) -> list[int]:
    if mode == "whole":
        return []
    if mode == "end-byte-by-byte":
        return list(range(len(data) - 12, len(data)))
    if mode == "around-every-dot":
        return sorted({i + d for i, b in enumerate(data) if b == ord(".") for d in (0, 1, 2)})
    rng = random.Random(20261129)
    return sorted(rng.sample(range(1, len(data)), 40))


@pytest.mark.parametrize("mode", ["whole", "end-byte-by-byte", "around-every-dot", "random"])
async def test_dot_lines_arrive_unstuffed_however_the_bytes_are_cut(
    tmp: Path, upstream: Upstream, mode: str
) -> None:
    message = message_bytes(f"dots:{mode}", body=TRICKY_BODY)
    data = terminated(message)
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        code, _ = await transfer(guard.ports[0], data, cuts_for(mode, data))
    assert code == 250
    assert len(upstream.received) == 1
    assert body_of(upstream.received[0].content) == TRICKY_BODY


async def test_a_message_many_times_the_line_limit_with_dotted_lines(tmp: Path, upstream: Upstream) -> None:
    """Chunks end at the reader's limit when no ".\\r\\n" comes for a while, and at every
    sentence that ends a line when one does: the message must come out whole either way."""
    rng = random.Random(7)
    lines = []
    for i in range(3000):
        words = " ".join("w" * rng.randint(1, 12) for _ in range(rng.randint(0, 12)))
        lines.append(f"{'.' if i % 7 == 0 else ''}{i} {words}{'.' if i % 3 == 0 else ''}".encode())
    body = b"\r\n".join(lines) + b"\r\n"
    async with running_guard(base_config(tmp, upstream.port, limits__max_line_length=LINE_LIMIT)) as guard:
        code, _ = await transfer(guard.ports[0], terminated(message_bytes("big:1", body=body)), [])
    assert code == 250
    assert body_of(upstream.received[0].content) == body


@pytest.mark.parametrize(
    ("offset", "length", "expected"),
    [
        # A line of exactly LINE_LIMIT octets with its CRLF is within the limit.
        pytest.param(0, LINE_LIMIT - 2, 250, id="at-the-limit"),
        pytest.param(0, LINE_LIMIT - 1, 500, id="one-over"),
        # The same long line placed so that it straddles the reader's chunks.
        pytest.param(900, LINE_LIMIT - 1, 500, id="one-over-across-chunks"),
        pytest.param(1950, LINE_LIMIT - 2, 250, id="at-the-limit-across-chunks"),
        pytest.param(1950, 5 * LINE_LIMIT, 500, id="far-over-across-chunks"),
    ],
)
async def test_line_length_is_judged_per_line_wherever_the_chunks_end(
    tmp: Path, upstream: Upstream, offset: int, length: int, expected: int
) -> None:
    filler = b""
    while len(filler) < offset:
        filler += b"filler line that ends in a dot.\r\n"
    body = filler + b"L" * length + b"\r\nafter\r\n"
    data = terminated(message_bytes(f"line:{offset}:{length}", body=body))
    async with running_guard(base_config(tmp, upstream.port, limits__max_line_length=LINE_LIMIT)) as guard:
        code, enhanced = await transfer(guard.ports[0], data, cuts_for("random", data))
    assert code == expected
    if expected == 250:
        assert body_of(upstream.received[0].content) == body
    else:
        assert enhanced == "5.5.2"
        assert upstream.handler.transactions == 0


async def test_commands_pipelined_after_the_dot_are_answered(tmp: Path, upstream: Upstream) -> None:
    """RFC 2920: the end of data and the next commands may come in one segment; nothing past
    the dot may be taken for message data."""
    first = terminated(message_bytes("pipe:1"))
    second = terminated(message_bytes("pipe:2"))
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        c.write(b"MAIL FROM:<billing@acme.example>\r\nRCPT TO:<customer@example.com>\r\nDATA\r\n")
        assert [(await c.reply()).code for _ in range(3)] == [250, 250, 354]
        c.write(first + b"MAIL FROM:<billing@acme.example>\r\nRCPT TO:<customer@example.com>\r\nDATA\r\n")
        assert [(await c.reply()).code for _ in range(4)] == [250, 250, 250, 354]
        c.write(second + b"QUIT\r\n")
        assert [(await c.reply()).code for _ in range(2)] == [250, 221]
    assert upstream.event_keys() == ["pipe:1", "pipe:2"]


async def test_an_empty_transfer_is_refused_and_the_session_goes_on(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        code, _ = await transfer(guard.ports[0], b".\r\n", [])
    assert 500 <= code < 600
    assert upstream.handler.transactions == 0


@pytest.mark.parametrize(
    "ending",
    [
        pytest.param(b"\n.\r\n", id="lf-dot-crlf"),
        pytest.param(b"\r\n.\n", id="crlf-dot-lf"),
        pytest.param(b"\r.\r\n", id="cr-dot-crlf"),
    ],
)
async def test_a_bare_newline_around_the_dot_is_not_the_end(
    tmp: Path, upstream: Upstream, ending: bytes
) -> None:
    """Smuggling relies on a server that ends the data at one of these; smtpguard reads on
    to the real end and refuses the message for its bare newline."""
    smuggled = message_bytes("smuggle:1") + b"x" + ending + b"MAIL FROM:<ceo@acme.example>\r\n"
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        code, enhanced = await transfer(guard.ports[0], smuggled + b"\r\n.\r\n", [])
    assert (code, enhanced) == (550, "5.5.2")
    assert upstream.handler.transactions == 0


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        # A line whose text starts with a dot reaches the wire with a second one: that
        # transparency dot is not counted (RFC 5321 4.5.3.1.6).
        pytest.param(LINE_LIMIT - 2, 250, id="dotted-at-the-limit"),
        pytest.param(LINE_LIMIT - 1, 500, id="dotted-one-over"),
    ],
)
async def test_the_transparency_dot_does_not_count_toward_the_line_limit(
    tmp: Path, upstream: Upstream, content: int, expected: int
) -> None:
    body = b"." + b"D" * (content - 1) + b"\r\nafter\r\n"
    data = terminated(message_bytes(f"dotline:{content}", body=body))
    assert b"\r\n.." in data  # the client stuffed it
    async with running_guard(base_config(tmp, upstream.port, limits__max_line_length=LINE_LIMIT)) as guard:
        code, _ = await transfer(guard.ports[0], data, [])
    assert code == expected
    if expected == 250:
        assert body_of(upstream.received[0].content) == body
    else:
        assert upstream.handler.transactions == 0
