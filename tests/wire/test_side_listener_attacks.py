"""Attacks on the side listeners' limits (DESIGN.md §18) that the limits' own tests did not
try, each on real sockets: a console form body cut short, TLS handshakes that never finish,
a mailbox session piling up recipients, Postmark credentials guessed from the provider's
own addresses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smtpguard.server import Server
from tests.support import Upstream, base_config, password_hash, running_guard
from tests.support import events as ev
from tests.support.eventually import eventually
from tests.support.hostile import MAILBOX
from tests.wire.test_side_listener_limits import released_to

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
    return await eventually(lambda: caplog.messages.count(message), lambda c: c >= n, timeout=2, interval=0.1)


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
        writer.close()
    else:
        assert await until_closed(reader) < READ + 1.0
        writer.close()
    assert await logged(caplog, "console: request body aborted", 1) == 1
    assert "console: request failed" not in caplog.messages


async def test_tls_handshakes_that_never_finish_are_within_the_console_caps(
    tmp: Path, upstream: Upstream, no_tracebacks: None
) -> None:
    """A TLS handshake comes before the first request: if the caps counted only connections
    whose handshake was done, stalled handshakes would take descriptors without limit for
    read_timeout each (3 per address and 8 in total here)."""
    import ssl

    from tests.support.hostile import make_cert

    cert, key = make_cert(tmp)
    cfg = console_cfg(tmp, upstream, tls={"cert": str(cert), "key": str(key)})
    async with running_guard(cfg) as guard:
        assert guard.console is not None
        port = guard.console.port
        # 12 connections from one address that never send a ClientHello.
        stalled = [
            await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.20", 0)) for _ in range(12)
        ]
        took = await asyncio.gather(*(until_closed(r, 3) for r, _ in stalled))
        refused_at_once = sum(t < READ / 2 for t in took)
        cut_by_deadline = sum(READ - 0.1 <= t < READ + 1.0 for t in took)
        assert (refused_at_once, cut_by_deadline) == (9, 3), sorted(round(t, 2) for t in took)
        for _, w in stalled:
            w.close()
        # The slots came back once the handshakes were cut: the same address gets its 3
        # connections again, each served.
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        browsers = [
            await asyncio.open_connection("127.0.0.1", port, ssl=ctx, local_addr=("127.0.0.20", 0))
            for _ in range(3)
        ]
        for reader, writer in browsers:
            writer.write(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port)
            assert (await asyncio.wait_for(reader.readline(), 2)).startswith(b"HTTP/1.1 200")
        for _, writer in browsers:
            writer.close()


async def test_a_request_sent_with_the_tls_finished_message_is_served(tmp: Path, upstream: Upstream) -> None:
    """A TLS 1.3 client sends its request right behind its Finished, often in one segment
    (browsers do): the console, which admits a connection at accept and only then hands it
    to the event loop's TLS, must not lose those bytes."""
    import socket
    import ssl

    from tests.support.hostile import make_cert

    cert, key = make_cert(tmp)
    cfg = console_cfg(tmp, upstream, tls={"cert": str(cert), "key": str(key)})
    async with running_guard(cfg) as guard:
        assert guard.console is not None
        port = guard.console.port
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(incoming, outgoing, server_side=False)
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        try:
            async with asyncio.timeout(3):
                while True:
                    try:
                        tls.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        if outgoing.pending:
                            await loop.sock_sendall(sock, outgoing.read())
                        incoming.write(await loop.sock_recv(sock, 65536))
                # The client's Finished is still in `outgoing`: the request goes with it.
                tls.write(b"GET /login HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port)
                await loop.sock_sendall(sock, outgoing.read())
                answer = b""
                while b"\r\n" not in answer:
                    try:
                        answer += tls.read(65536)
                    except ssl.SSLWantReadError:
                        data = await loop.sock_recv(sock, 65536)
                        assert data, "the console closed the connection"
                        incoming.write(data)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
        finally:
            sock.close()


async def test_a_mailbox_session_takes_at_most_100_recipients(tmp: Path, upstream: Upstream) -> None:
    """The mailbox takes mail for one address: a session repeating RCPT would otherwise grow
    its envelope without end (about 130 bytes a recipient, 318,000 of them measured in four
    sessions in a minute), one command at a time, each within its deadline."""
    cfg = base_config(tmp, upstream.port, events={"mailbox": MAILBOX})
    async with running_guard(cfg) as guard:
        assert guard.mailbox is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", guard.mailbox.port)
        try:
            assert (await asyncio.wait_for(reader.readline(), 2)).startswith(b"220")
            writer.write(
                b"HELO reporter.example\r\nMAIL FROM:<>\r\n" + b"RCPT TO:<reports@guard.test>\r\n" * 150
            )
            codes = [(await asyncio.wait_for(reader.readline(), 5))[:9] for _ in range(124)]
        finally:
            writer.close()
    assert [c[:3] for c in codes[:2]] == [b"250", b"250"], codes[:2]
    rcpt = codes[2:]
    assert [c[:3] for c in rcpt].count(b"250") == 100
    # Each recipient past the limit is an error of this stranger's: the 20th ends the
    # session (smtp_session.py), and the 30 RCPT after it are never read.
    assert rcpt[100:120] == [b"452 4.5.3"] * 20
    assert rcpt[120:] == [b"421 4.7.0", b""], rcpt[120:]


async def _pipeline_unread(port: int, source: str, request: bytes) -> socket.socket:
    """A client that sends requests and never reads an answer: pipelined until the listener
    stops taking them (its answers back up), bounded at 10 s."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    sock.bind((source, 0))
    await loop.sock_connect(sock, ("127.0.0.1", port))
    started = time.monotonic()
    # Sending stops when the listener stops reading, or cuts the connection.
    with contextlib.suppress(TimeoutError, ConnectionError):
        while time.monotonic() - started < 10:
            await asyncio.wait_for(loop.sock_sendall(sock, request * 20), 1)
    return sock


@pytest.mark.parametrize("listener", ["events", "console"])
async def test_a_client_that_never_reads_its_answers_is_closed(
    tmp: Path, upstream: Upstream, listener: str, caplog: pytest.LogCaptureFixture, no_tracebacks: None
) -> None:
    """Requests arrive whole and in time, so read_timeout never runs; the answers wait for a
    client that does not read them, so idle_timeout never runs either: without a deadline on
    writing, such connections were held for good (3 of them took an address's whole
    allowance, 256 the listener), 30 s measured with read_timeout 1 s and idle_timeout 2 s."""
    keys = ev.Keys.make(tmp)
    cfg = console_cfg(tmp, upstream)
    cfg["events"] = {"address": "127.0.0.1:0", "sources": keys.sources(), **LIMITS}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in keys.env().items():
            mp.setenv(name, value)
        async with running_guard(cfg) as guard:
            assert guard.events is not None and guard.console is not None
            port = guard.events.port if listener == "events" else guard.console.port
            # Answers of some kilobytes each (a 404 naming the source asked for; the login
            # page), so that a few hundred fill the socket's buffers.
            path = b"POST /events/" + b"n" * 4000 if listener == "events" else b"GET /login"
            request = b"%s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 0\r\n\r\n" % (path, port)
            held = [await _pipeline_unread(port, "127.0.0.26", request) for _ in range(3)]
            try:
                # Each was admitted (refused ones would be closed, and sending would fail).
                assert await logged(caplog, "response not taken within read_timeout", 3) == 3
                # Their slots are back: the same address is served again.
                await released_to(guard, listener, 0)
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=("127.0.0.26", 0)
                )
                writer.write(request)
                status = await asyncio.wait_for(reader.readline(), 2)
                assert status.split()[1] in (b"200", b"404"), status
                writer.close()
            finally:
                for sock in held:
                    sock.close()


async def test_a_mailbox_client_that_never_reads_its_replies_is_cut(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    """The SMTP form of the same attack: commands pipelined (HELP, each answered at once)
    and the replies never read. Measured before: three such sessions held their address's
    allowance for 60 s and more, with read_timeout 600 ms and idle_timeout 1.2 s (aiosmtpd's
    idle close waits for the replies to be read). Now the junk command limit ends the
    session at the 120th HELP, before its replies can back up (or, past the socket
    buffers, the write deadline would): either way the slot is freed."""
    cfg = base_config(
        tmp,
        upstream.port,
        events={
            "mailbox": {
                "listen": "127.0.0.1:0",
                "address": "reports@guard.test",
                "provider": "primary",
                **LIMITS,
            }
        },
    )
    # INFO, not DEBUG: aiosmtpd logs each command at DEBUG, and there are 30,000.
    caplog.set_level(logging.INFO)
    async with running_guard(cfg) as guard:
        assert guard.mailbox is not None
        port = guard.mailbox.port
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.setblocking(False)
        sock.bind(("127.0.0.27", 0))
        await loop.sock_connect(sock, ("127.0.0.1", port))
        try:
            # 180 kB of HELP: their replies (2.4 MB) are more than the socket buffers hold.
            with contextlib.suppress(TimeoutError, ConnectionError):
                for _ in range(30):
                    await asyncio.wait_for(loop.sock_sendall(sock, b"HELP\r\n" * 1000), 1)
            assert await logged(caplog, "too many errors; session closed", 1) == 1
            # The connection is gone, and its slot with it.
            await released_to(guard, "mailbox", 0)
        finally:
            sock.close()
