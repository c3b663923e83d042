"""Reloads while a client is mid-transaction, as an operator's SIGHUP meets live traffic:
whatever the reload changes (the provider's address, the zone's plan), a message the
client is sending or that the relay is carrying reaches the upstream exactly once and a
retry of its event is a duplicate. Real clients, real recording upstreams, a real SQLite
file; the reload re-reads the config file as SIGHUP does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.support import (
    Behaviour,
    Upstream,
    base_config,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.hostile import session


def _provider(tmp: Path, port: int) -> dict[str, Any]:
    """The tests' provider at `port`, with room for a held dot (data 5s) and 2 connections."""
    provider: dict[str, Any] = base_config(tmp, port)["providers"][0]
    return {**provider, "timeouts": {**provider["timeouts"], "data": "5s"}, "pool_size": 2}


async def test_a_reload_moving_the_provider_while_a_relay_is_held_sends_once(tmp: Path) -> None:
    """The upstream holds its answer to the final dot; meanwhile a reload points `primary`
    at another upstream. The held message is answered 250 from the first upstream, its retry
    is a duplicate (nothing sent to either), and the next event goes to the new address
    only: no pooled connection to the old address carries it."""
    old, new = Upstream(), Upstream()
    await old.start()
    await new.start()
    held = asyncio.Event()
    old.handler.script.append(Behaviour(hold_after_dot=held))
    cfg = base_config(tmp, old.port)
    cfg["providers"] = [_provider(tmp, old.port)]
    path = tmp / "smtpguard.yaml"
    try:
        async with running_guard(cfg, config_path=path) as guard:
            port = guard.ports[0]
            first = asyncio.create_task(send(port, message("reload:1")))
            await old.wait_received(1)
            cfg["providers"] = [_provider(tmp, new.port)]
            cfg["zones"]["acme"]["plan"] = "agency"
            write_config(path, cfg)
            assert await guard.reload()
            held.set()
            reply = await asyncio.wait_for(first, 15)
            assert reply.code == 250 and "queued as Q1" in reply.text
            again = await send(port, message("reload:1"))
            assert again.code == 250 and "duplicate" in again.text
            assert (await send(port, message("reload:2"))).code == 250
            await new.wait_received(1)
    finally:
        await old.stop()
        await new.stop()
    assert old.event_keys() == ["reload:1"]
    assert new.event_keys() == ["reload:2"]


async def test_a_reload_between_the_halves_of_a_clients_data_sends_once(
    tmp: Path, upstream: Upstream
) -> None:
    """A client has AUTH, MAIL, RCPT and half its DATA in when a reload changes the zone's
    plan and the provider's timeouts; the second half and the final dot follow. One 250, one
    message at the upstream, byte for byte the body sent; the retry is a duplicate."""
    cfg = base_config(tmp, upstream.port)
    path = tmp / "smtpguard.yaml"
    raw = message("reload:data", body="first half\nsecond half\n").as_bytes().replace(b"\n", b"\r\n")
    half = raw.index(b"second half")
    async with running_guard(cfg, config_path=path) as guard:
        port = guard.ports[0]
        async with session(port) as c:
            assert (await c.command("MAIL FROM:<billing@acme.example>")).code == 250
            assert (await c.command("RCPT TO:<customer@example.com>")).code == 250
            assert (await c.command("DATA")).code == 354
            c.write(raw[:half])
            cfg["zones"]["acme"]["plan"] = "agency"
            cfg["providers"][0]["timeouts"]["data"] = "4s"
            write_config(path, cfg)
            assert await guard.reload()
            c.write(raw[half:] + b".\r\n")
            final = await c.reply()
            assert (final.code, final.enhanced) == (250, "2.0.0"), final
        again = await send(port, message("reload:data", body="first half\nsecond half\n"))
        assert again.code == 250 and "duplicate" in again.text
    assert upstream.event_keys() == ["reload:data"]
    assert b"first half\r\nsecond half\r\n" in upstream.received[0].content
