"""Attacks on the side listeners' limits (DESIGN.md §18) that the limits' own tests did not
try, each on real sockets: a console form body cut short, TLS handshakes that never finish,
a mailbox session piling up recipients, Postmark credentials guessed from the provider's
own addresses."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smtpguard.server import Server
from tests.support import Upstream, base_config, password_hash, running_guard

READ = 0.6
LIMITS = {
    "max_connections": 8,
    "max_connections_per_ip": 3,
    "read_timeout": "600ms",
    "idle_timeout": "1200ms",
}


def console_cfg(tmp: Path, upstream: Upstream, **extra: object) -> dict[str, object]:
    return base_config(
        tmp,
        upstream.port,
        console={
            "address": "127.0.0.1:0",
            "operators": [{"username": "alice", "password_hash": password_hash("pw-alice-1")}],
            **LIMITS,
            **extra,
        },
    )


@pytest.fixture
async def console(tmp: Path, upstream: Upstream) -> AsyncIterator[Server]:
    async with running_guard(console_cfg(tmp, upstream)) as server:
        yield server


async def until_closed(reader: asyncio.StreamReader, limit: float = 5) -> float:
    """Seconds until the peer closes (bounded by `limit`)."""
    started = time.monotonic()
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(limit):
            while await reader.read(4096):
                pass
    return time.monotonic() - started


async def logged(caplog: pytest.LogCaptureFixture, message: str, n: int) -> int:
    """How many times `message` was logged, once it was `n` times or 2 s passed."""
    for _ in range(20):  # bounded: 2 s
        if caplog.messages.count(message) >= n:
            break
        await asyncio.sleep(0.1)
    return caplog.messages.count(message)


@pytest.mark.parametrize("how", ["client closes", "read_timeout"])
async def test_a_console_form_body_cut_short_is_one_line_without_a_traceback(
    console: Server, caplog: pytest.LogCaptureFixture, no_tracebacks: None, how: str
) -> None:
    assert console.console is not None
    port = console.console.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # A Host the console answers for, so the body is read (a foreign Host is 421 unread).
    writer.write(
        b"POST /login HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ncsrf=ab" % port
    )
    await writer.drain()
    if how == "client closes":
        await asyncio.sleep(0.1)
        writer.close()
    else:
        assert await until_closed(reader) < READ + 1.0
        writer.close()
    assert await logged(caplog, "console: request body aborted", 1) == 1
    assert "console: request failed" not in caplog.messages
