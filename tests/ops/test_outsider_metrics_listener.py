"""The metrics listener (/metrics, /healthz, /readyz) under a flood: it takes no
authentication and is often reachable by every process on the host (or a management
network, `0.0.0.0:9587` in a container), so a slowloris there must not use up the
descriptors the SMTP listener shares. 600 connections from three addresses, each sending a
header line every 2 s (inside the old 5 s per-line wait, which alone let them stay for
good), with smtpguard in its own process under a 512-descriptor limit: those over the
per-address cap are closed at accept, the others when their 5 s are up; an SMTP
submission is answered 250 and reaches the upstream once, and a scrape of /readyz from
another address is answered within 2 s. Before the caps and the request deadline the SMTP
client's connection was closed unanswered (the descriptors were used up)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from tests.support import GuardProcess, Upstream, base_config, free_port, message, send, write_config
from tests.wire.test_side_listener_floods import WITH_NOFILE

pytestmark = pytest.mark.slow

FLOOD = 600
ATTACKERS = ["127.0.0.10", "127.0.0.11", "127.0.0.12"]
GENUINE = "127.0.0.2"


async def _scrape(port: int, path: str) -> tuple[str, float]:
    started = time.monotonic()
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, local_addr=(GENUINE, 0)), 5
    )
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        status = (await asyncio.wait_for(reader.readline(), 5)).decode().strip()
    finally:
        writer.close()
    return status, time.monotonic() - started


async def _open(reader: asyncio.StreamReader) -> bool:
    """Whether smtpguard still holds this connection (no EOF, no reset from its side)."""
    try:
        await asyncio.wait_for(reader.read(), 0.05)
    except TimeoutError:
        return True
    except OSError:
        return False
    return False


async def test_a_slowloris_on_the_metrics_port_leaves_smtp_and_scrapes_served(
    tmp: Path, upstream: Upstream
) -> None:
    smtp, metrics = free_port(), free_port()
    cfg = base_config(
        tmp,
        upstream.port,
        listen=[{"address": f"127.0.0.1:{smtp}", "tls": "none"}],
        metrics={"address": f"127.0.0.1:{metrics}"},
    )
    proc = GuardProcess(write_config(tmp / "guard.yaml", cfg), tmp / "guard.log", WITH_NOFILE)
    proc.start()
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    stop = asyncio.Event()

    async def trickle(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write(b"GET /metrics HTTP/1.1\r\n")
            while not stop.is_set():
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 2)

    tasks = []
    try:
        await proc.wait_port(smtp)
        await proc.wait_port(metrics)
        for batch in range(0, FLOOD, 48):
            opened = await asyncio.gather(
                *(
                    asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", metrics, local_addr=(ATTACKERS[i % 3], 0)), 3
                    )
                    for i in range(batch, batch + 48)
                ),
                return_exceptions=True,
            )
            for conn in opened:
                if isinstance(conn, BaseException):
                    continue
                held.append(conn)
                tasks.append(asyncio.create_task(trickle(conn[1])))
        await asyncio.sleep(7)  # past the old per-line wait: only a request deadline ends them
        reply = await send(smtp, message("flood:1"), timeout=10)
        assert reply.code == 250, reply
        status, took = await _scrape(metrics, "/readyz")
        assert status == "HTTP/1.1 200 OK" and took < 2, (status, took)
        still_open = sum([await _open(r) for r, _ in held])
        assert still_open == 0, f"{still_open} of {len(held)} flood connections still open"
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        for _, w in held:
            w.close()
        proc.kill()
    assert upstream.event_keys() == ["flood:1"]
    assert "Traceback" not in (tmp / "guard.log").read_text()
