"""SIGHUP to a real `serve` with `workers: 2` while one client is half way through its DATA
and another's message is held at the upstream after its final dot: both workers reload
(the zone's plan and the provider's timeouts change), both messages are answered 250 and
reach the upstream once, and their retries are duplicates. Counted at the upstream."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from tests.ops.test_workers import pool, wait_for
from tests.support import Behaviour, Upstream, message, send, write_config
from tests.support.hostile import session


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
        async with session(p.port) as c:
            assert (await c.command("MAIL FROM:<billing@acme.example>")).code == 250
            assert (await c.command("RCPT TO:<customer@example.com>")).code == 250
            assert (await c.command("DATA")).code == 354
            c.write(raw[:half])
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
            c.write(raw[half:] + b".\r\n")
            final = await c.reply(timeout=15)
            assert (final.code, final.enhanced) == (250, "2.0.0"), final
        first = await asyncio.wait_for(relayed, 60)
        assert first.code == 250 and "duplicate" not in first.text, first
        for key in ("hup:held", "hup:data"):
            body = "first half\nsecond half\n" if key == "hup:data" else "Your invoice.\n"
            again = await send(p.port, message(key, body=body))
            assert again.code == 250 and "duplicate" in again.text, (key, again)
    assert sorted(k or "" for k in upstream.event_keys()) == ["hup:data", "hup:held"]
