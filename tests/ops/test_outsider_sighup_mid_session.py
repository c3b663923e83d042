"""SIGHUP to a real `serve` with `workers: 2` while one client is half way through its DATA
and another's message is held at the upstream after its final dot: both workers reload
(the zone's plan and the provider's timeouts change), both messages are answered 250 and
reach the upstream once, and their retries are duplicates. Counted at the upstream."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
from pathlib import Path

from tests.ops.test_workers import pool, wait_for
from tests.support import PASSWORD, Behaviour, Upstream, message, send, write_config


async def _line(reader: asyncio.StreamReader) -> bytes:
    while True:
        got = await asyncio.wait_for(reader.readline(), 15)
        if got[3:4] != b"-":
            return got


async def test_sighup_to_two_workers_mid_data_and_mid_relay_sends_each_once(
    tmp: Path, upstream: Upstream
) -> None:
    held = asyncio.Event()
    upstream.handler.script.append(Behaviour(hold_after_dot=held))
    raw = message("hup:data", body="first half\nsecond half\n").as_bytes().replace(b"\n", b"\r\n")
    half = raw.index(b"second half")
    async with pool(tmp, upstream) as p:
        relayed = asyncio.create_task(send(p.port, message("hup:held"), timeout=60))
        await upstream.wait_received(1)
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        try:
            assert (await _line(reader)).startswith(b"220")
            for command, code in (
                (b"EHLO client.test", b"250"),
                (b"AUTH PLAIN " + base64.b64encode(b"\0acme-app\0" + PASSWORD.encode()), b"235"),
                (b"MAIL FROM:<billing@acme.example>", b"250"),
                (b"RCPT TO:<customer@example.com>", b"250"),
                (b"DATA", b"354"),
            ):
                writer.write(command + b"\r\n")
                assert (await _line(reader)).startswith(code), command
            writer.write(raw[:half])
            await writer.drain()
            cfg = p.cfg
            cfg["zones"]["acme"]["plan"] = "agency"
            cfg["providers"][0]["timeouts"]["data"] = "4s"
            write_config(p.config_path, cfg)
            os.kill(p.guard.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
            await wait_for(
                "both workers reloaded",
                lambda: sum(e.get("msg") == "config reloaded" for e in p.lines()) == 2,
            )
            held.set()
            writer.write(raw[half:] + b".\r\n")
            final = await _line(reader)
            assert final.startswith(b"250 2.0.0"), final
            writer.write(b"QUIT\r\n")
        finally:
            writer.close()
        first = await asyncio.wait_for(relayed, 60)
        assert first.code == 250 and "duplicate" not in first.text, first
        for key in ("hup:held", "hup:data"):
            body = "first half\nsecond half\n" if key == "hup:data" else "Your invoice.\n"
            again = await send(p.port, message(key, body=body))
            assert again.code == 250 and "duplicate" in again.text, (key, again)
    assert sorted(k or "" for k in upstream.event_keys()) == ["hup:data", "hup:held"]
