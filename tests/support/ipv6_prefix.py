"""Run inside a network namespace of its own (tests/wire/test_ipv6_prefix_limits.py): twelve
addresses of one IPv6 /64 on its loopback, and smtpguard listening on [::1]. Prints, as JSON,
the replies AUTH guesses and held connections from those addresses got, and what the upstream
received. Nothing here touches the host's network."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tests.support import Upstream, base_config, running_guard
from tests.support.eventually import eventually

PREFIX = "fd00:5e::"
ADDRESSES = [f"{PREFIX}{i}" for i in range(1, 13)]


async def _line(reader: asyncio.StreamReader) -> str:
    while True:
        got = await asyncio.wait_for(reader.readline(), 10)
        if got[3:4] != b"-":
            return got.decode()[:3] or "closed"


async def _guess(port: int, source: str) -> str:
    reader, writer = await asyncio.open_connection("::1", port, local_addr=(source, 0))
    try:
        await _line(reader)
        writer.write(b"EHLO client.test\r\n")
        await _line(reader)
        writer.write(b"AUTH PLAIN " + base64.b64encode(b"\0acme-app\0a-wrong-guess") + b"\r\n")
        return await _line(reader)
    finally:
        writer.close()
        await writer.wait_closed()


async def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    upstream = Upstream()
    await upstream.start()
    cfg = base_config(tmp, upstream.port, limits={"auth_failures": 3, "max_connections_per_ip": 2})
    cfg["listen"] = [{"address": "[::1]:0", "tls": "none"}]
    try:
        async with running_guard(cfg) as server:
            assert server.handler is not None
            port = server.ports[0]
            auth = Counter([await _guess(port, source) for source in ADDRESSES for _ in range(5)])
            handler = server.handler
            await eventually(lambda: handler.connections.total, lambda n: n == 0, timeout=10, interval=0.05)
            held, greetings = [], Counter[str]()
            for source in ADDRESSES:
                for _ in range(3):
                    reader, writer = await asyncio.open_connection("::1", port, local_addr=(source, 0))
                    greetings[await _line(reader)] += 1
                    held.append(writer)
            for writer in held:
                writer.close()
    finally:
        await upstream.stop()
    json.dump({"auth": auth, "greetings": greetings, "upstream": len(upstream.received)}, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
