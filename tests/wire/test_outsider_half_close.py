"""A client that half-closes its side of the connection (TCP FIN after its last command),
as `printf … | nc -N`, socat and many one-shot senders do once their input ends.

A half-close says "I have nothing more to send", not "forget what I sent": Postfix's smtpd
reads and answers every command already received, and the replies go out on the half still
open. aiosmtpd's default cancels the session at the EOF, dropping the pipelined commands in
its buffer unanswered. Counted at the recording upstream: a whole transaction sent before
the FIN is relayed once and answered; a transaction cut by the FIN (mid-DATA) relays nothing
and records nothing; every connection slot is given back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import (
    CLOSED,
    RawClient,
    all_released,
    message_bytes,
    nothing_recorded,
    session,
    terminated,
)

pytestmark = pytest.mark.usefixtures("no_tracebacks")

ENVELOPE = b"MAIL FROM:<billing@acme.example>\r\nRCPT TO:<customer@example.com>\r\nDATA\r\n"


async def test_commands_sent_before_a_half_close_are_all_answered(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        async with session(guard.ports[0]) as c:
            c.write(ENVELOPE + terminated(message_bytes("half:1")) + b"QUIT\r\n")
            await c.writer.drain()
            c.writer.write_eof()
            replies = [await c.reply() for _ in range(5)]
            assert await c.closed()
        assert await all_released(guard)
    assert [r.code for r in replies] == [250, 250, 354, 250, 221], replies
    assert upstream.event_keys() == ["half:1"]


async def test_a_half_close_in_the_middle_of_data_relays_and_records_nothing(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        async with session(guard.ports[0]) as c:
            c.write(ENVELOPE + terminated(message_bytes("half:2"))[:40])
            await c.writer.drain()
            c.writer.write_eof()
            replies = [await c.reply() for _ in range(4)]
            assert await c.closed()
        assert await all_released(guard)
        assert await nothing_recorded(guard, "acme", "half:2")
    assert [r.code for r in replies] == [250, 250, 354, 0], replies
    assert replies[-1] == CLOSED
    assert upstream.received == []


async def test_a_half_close_at_the_greeting_or_mid_command_gives_the_slot_back(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        silent = await RawClient.connect(guard.ports[0])
        silent.writer.write_eof()
        assert await silent.closed()
        async with session(guard.ports[0]) as c:
            c.write(b"MAIL FROM:<billing@acme")  # no CRLF: a command never finished
            await c.writer.drain()
            c.writer.write_eof()
            assert await c.reply() == CLOSED
        async with session(guard.ports[0]) as c:
            c.write(b"MAIL FROM:<" + b"x" * 5000)  # over max_line_length, then the FIN
            await c.writer.drain()
            c.writer.write_eof()
            assert await c.reply() == CLOSED
        await silent.close()
        assert await all_released(guard)
    assert upstream.received == []
