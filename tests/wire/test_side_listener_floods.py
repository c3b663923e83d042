"""The side listeners hold under a flood (DESIGN.md §18): 300 idle and 300 trickling
connections to the events port, the console or the mailbox, while a genuine signed webhook
is answered 200 within 2 s and applied, and an SMTP submission gets its 250 and reaches the
upstream exactly once.

smtpguard runs as its own process with a file-descriptor limit (RLIMIT_NOFILE) below what 600
connections need: without caps the flood used up the descriptors and the SMTP listener
stopped accepting; without per-request deadlines 64 body tricklers held every webhook slot
(503 for every source). The listeners run with their default limits (256 in total, 32 per
address, read_timeout 10 s, idle_timeout 15 s); the flood comes from five loopback addresses,
the genuine clients from others.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import aiosmtplib
import pytest

from tests.events.test_events import RCPT
from tests.support import (
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    message,
    password_hash,
    send,
    write_config,
)
from tests.support import events as ev

pytestmark = pytest.mark.slow

ATTACKERS = [f"127.0.0.{n}" for n in range(10, 15)]
GENUINE = "127.0.0.2"
IDLE = TRICKLE = 300
NOFILE = 512
"""Below the ~650 descriptors 600 admitted connections take, well above the ~220 the caps
let the flood take (5 addresses, 32 each, plus smtpguard's own)."""
WITH_NOFILE = (
    sys.executable,
    "-c",
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE})); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)
"""Runs serve under the lowered limit (what `prlimit --nofile` does, without needing it)."""
PER_IP = 32
ANSWER_WITHIN = 10
"""The genuine clients' own timeout: well inside the flood's holds (IDLE, TRICKLE: 300 s), so
a genuine client left waiting behind the flood fails its request."""


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream, keys: ev.Keys) -> AsyncIterator[dict[str, int]]:
    ports = {name: free_port() for name in ("smtp", "events", "console", "mailbox")}
    cfg = base_config(
        tmp,
        upstream.port,
        listen=[{"address": f"127.0.0.1:{ports['smtp']}", "tls": "none"}],
        events={
            "address": f"127.0.0.1:{ports['events']}",
            "sources": keys.sources(),
            "mailbox": {
                "listen": f"127.0.0.1:{ports['mailbox']}",
                "address": "reports@guard.test",
                "provider": "primary",
            },
        },
        console={
            "address": f"127.0.0.1:{ports['console']}",
            "operators": [{"username": "alice", "password_hash": password_hash("pw-alice-1")}],
        },
    )
    proc = GuardProcess(write_config(tmp / "guard.yaml", cfg), tmp / "guard.log", WITH_NOFILE)
    proc.start()
    try:
        for port in ports.values():
            await proc.wait_port(port)
        yield ports
    finally:
        proc.kill()
    assert "Traceback" not in (tmp / "guard.log").read_text()


class Flood:
    """IDLE connections that send nothing and TRICKLE that send one byte a second, from
    ATTACKERS in turn. A connection refused at its cap gets a reply and is closed at once."""

    def __init__(self, port: int, trickle_start: bytes, trickle_byte: bytes) -> None:
        self.port = port
        self.start_bytes = trickle_start
        self.byte = trickle_byte
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.trickling: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.failed_connects = 0
        self._task: asyncio.Task[None] | None = None

    async def _open(self, i: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", self.port, local_addr=(ATTACKERS[i % 5], 0)), 3
            )
        except (OSError, TimeoutError):
            self.failed_connects += 1
            return None

    async def open(self) -> None:
        opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None] = []
        # In batches under the listen backlog (100): past it the kernel holds handshakes
        # the listener has not seen yet, and the count below would be a race with that.
        for batch in range(0, IDLE + TRICKLE, 50):
            opened += await asyncio.gather(*(self._open(i) for i in range(batch, batch + 50)))
        for i, conn in enumerate(opened):
            if conn is None:
                continue
            (self.idle if i % 2 else self.trickling).append(conn)
        for n, (_, w) in enumerate(self.trickling):
            # Half trickle from their first byte, half after whole headers or commands.
            if n % 2 and self.start_bytes:
                _write(w, self.start_bytes)
        self._task = asyncio.create_task(self._trickle())

    async def _trickle(self) -> None:
        for _ in range(120):  # bounded: the test is over long before
            for _, w in self.trickling:
                _write(w, self.byte)
            await asyncio.sleep(1)

    async def refused(self) -> int:
        """Connections the listener answered and closed at once (over a cap)."""

        async def closed(r: asyncio.StreamReader) -> bool:
            try:
                await asyncio.wait_for(r.read(), 0.5)
                return r.at_eof()
            except ConnectionError:
                return True  # closed with the client's bytes unread: a reset, a broken pipe
            except TimeoutError:
                return False

        results = await asyncio.gather(*(closed(r) for r, _ in self.idle + self.trickling))
        return sum(results) + self.failed_connects

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for _, w in self.idle + self.trickling:
            w.close()


def _write(w: asyncio.StreamWriter, data: bytes) -> None:
    """A write that a connection the listener closed (refused, or cut off) ignores."""
    if not w.is_closing():
        with contextlib.suppress(OSError):
            w.write(data)


def _http_start(path: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: 100000\r\n\r\n"
    ).encode()


FLOODS: dict[str, tuple[bytes, bytes]] = {
    # Body tricklers on the very source the genuine webhook uses: they must not take its turn.
    "events": (_http_start("/events/ses"), b"x"),
    "console": (_http_start("/login"), b"x"),
    "mailbox": (b"EHLO slow.example\r\nMAIL FROM:<a@slow.example>\r\n", b"R"),
}


async def _genuine_webhook(port: int, keys: ev.Keys, message_id: str, queue_id: str) -> tuple[int, Any]:
    signed = ev.ses(keys, ev.ses_message("Bounce", RCPT, message_id, queue_id))
    connector = aiohttp.TCPConnector(local_addr=(GENUINE, 0))
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=ANSWER_WITHIN)) as s,
        s.post(f"http://127.0.0.1:{port}/events/ses", data=signed.body, headers=signed.headers) as r,
    ):
        doc = await r.json(content_type=None)
        return r.status, doc


async def _flooded_listener_serves(listener: str, port: int) -> None:
    """The flooded listener still serves a client from another address."""
    if listener == "mailbox":
        client = aiosmtplib.SMTP(
            hostname="127.0.0.1", port=port, timeout=ANSWER_WITHIN, source_address=(GENUINE, 0)
        )
        await client.connect()
        code, _ = await client.ehlo()
        await client.quit()
        assert code == 250
    else:
        connector = aiohttp.TCPConnector(local_addr=(GENUINE, 0))
        path = "/login" if listener == "console" else "/events/nosuch"
        within = aiohttp.ClientTimeout(total=ANSWER_WITHIN)
        async with (
            aiohttp.ClientSession(connector=connector, timeout=within) as s,
            s.get(f"http://127.0.0.1:{port}{path}") as r,
        ):
            assert r.status == (200 if listener == "console" else 405)


@pytest.mark.parametrize("listener", list(FLOODS))
async def test_a_flood_leaves_webhooks_and_submission_answered(
    listener: str, guard: dict[str, int], upstream: Upstream, keys: ev.Keys
) -> None:
    flood = Flood(guard[listener], *FLOODS[listener])
    try:
        await flood.open()
        await asyncio.sleep(1.5)  # the tricklers are well into their requests

        reply = await send(
            guard["smtp"], message("invoice:acme:flood", to=RCPT), recipients=[RCPT], timeout=10
        )
        assert reply.code == 250, reply
        assert [m.header("X-Event-Key") for m in upstream.received] == ["invoice:acme:flood"]
        message_id = upstream.received[0].header("Message-ID")
        assert message_id

        status, doc = await _genuine_webhook(guard["events"], keys, message_id, "Q1")
        assert status == 200, doc
        assert doc.get("applied") == 1, doc

        await _flooded_listener_serves(listener, guard[listener])

        # The caps, not luck: at most PER_IP from each attacking address were kept.
        refused = await flood.refused()
        assert refused >= IDLE + TRICKLE - PER_IP * len(ATTACKERS), refused
    finally:
        await flood.close()
    assert len(upstream.received) == 1
