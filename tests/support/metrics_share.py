"""Run inside a network namespace of its own (tests/ops/test_metrics_loopback_share.py):
four non-loopback addresses on its loopback device hold 32 trickling connections each to the
metrics listener (its whole total of 128), while health checks come from loopback. Prints,
as JSON, what 10 loopback /healthz checks and `smtpguard healthcheck` got, and how many
connections from a fifth remote address were let in meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from tests.support import Upstream, base_config, free_port, running_guard, write_config
from tests.support.eventually import eventually

ATTACKERS = ["10.9.0.10", "10.9.0.11", "10.9.0.12", "10.9.0.13"]
LATE = "10.9.0.14"


async def _hold(port: int, source: str, stop: asyncio.Event) -> None:
    """A connection that trickles a header line every second, reopened when it is cut."""
    while not stop.is_set():
        with contextlib.suppress(OSError, TimeoutError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
            writer.write(b"GET /metrics HTTP/1.1\r\n")
            while not stop.is_set() and not reader.at_eof():
                writer.write(b"X-a: b\r\n")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.read(1), 1)
            writer.close()
        await asyncio.sleep(0.05)


async def _get(port: int, source: str, path: str) -> str:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 2
        )
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), 2)
        writer.close()
        return line.decode().split(" ")[1] if line else "closed"
    except (OSError, TimeoutError) as e:
        return type(e).__name__


async def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    upstream = Upstream()
    await upstream.start()
    port = free_port()
    cfg = base_config(tmp, upstream.port)
    cfg["metrics"] = {"address": f"127.0.0.1:{port}"}
    stop = asyncio.Event()
    try:
        async with running_guard(cfg) as guard:
            assert guard.health is not None
            admission = guard.health.admission
            holders = [asyncio.create_task(_hold(port, a, stop)) for a in ATTACKERS for _ in range(32)]
            full = await eventually(lambda: admission.total, lambda n: n >= 128, timeout=10, interval=0.05)
            local = [await _get(port, "127.0.0.1", "/healthz") for _ in range(10)]
            late = await _get(port, LATE, "/healthz")
            path = write_config(tmp / "smtpguard.yaml", cfg)
            check = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "smtpguard", "healthcheck", "-c", str(path),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            healthcheck = await asyncio.wait_for(check.wait(), 30)
            stop.set()
            await asyncio.gather(*holders, return_exceptions=True)
    finally:
        await upstream.stop()
    json.dump({"local": local, "late": late, "healthcheck": healthcheck, "full": full}, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
