"""The base release (a89d5c7, before reserve.lua and consume.lua were built on the shared
lib/cap_unit.lua) and this one serving one Redis ledger side by side, as in a rolling
upgrade (DESIGN.md §18). The two releases' scripts differ in text, so each runs its own by
its own SHA on the one server: the caps they take must still be one count. A zone's hourly
cap and an SMTP user's own are filled by submissions alternating between the instances:
counted at the upstream, exactly the cap is sent, and every refusal is the cap's."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
import redis

from tests.support import (
    OTHER_PASSWORD,
    GuardProcess,
    RedisServer,
    Upstream,
    base_config,
    free_port,
    message,
    send,
    write_config,
)
from tests.support.releases import extract_release

pytestmark = pytest.mark.slow

BASE_RELEASE = "a89d5c7"
CAP = 3
TRIES = 2 * CAP


def config(tmp: Path, upstream: Upstream, url: str, instance: str, port: int) -> Path:
    cfg = base_config(tmp, upstream.port, instance=instance, store__url=url, store__unsafe=True)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    # acme: the user's own hourly cap is the one that fills; globex: the zone's.
    cfg["zones"]["acme"].update(plan="unlimited", hourly_cap=1000, monthly_cap=1000)
    cfg["zones"]["acme"]["users"][0]["hourly_cap"] = CAP
    cfg["zones"]["globex"].update(plan="unlimited", hourly_cap=CAP, monthly_cap=1000)
    return write_config(tmp / f"{instance}.yaml", cfg)


async def test_the_base_release_and_this_one_count_one_cap_on_one_redis(
    redis_server: RedisServer, tmp: Path, upstream: Upstream
) -> None:
    redis.Redis(port=redis_server.port).flushall()
    with tempfile.TemporaryDirectory(prefix="smtpguard-release-") as src:
        await asyncio.to_thread(extract_release, BASE_RELEASE, Path(src))
        old_port, new_port = free_port(), free_port()
        old = GuardProcess(
            config(tmp, upstream, redis_server.url, "old", old_port), tmp / "old.log", src=Path(src)
        )
        new = GuardProcess(config(tmp, upstream, redis_server.url, "new", new_port), tmp / "new.log")
        try:
            old.start()
            new.start()
            await old.wait_port(old_port, timeout=30)
            await new.wait_port(new_port, timeout=30)
            ports = (old_port, new_port)
            acme = [await send(ports[i % 2], message(f"roll:acme:{i}")) for i in range(TRIES)]
            globex = [
                await send(
                    ports[i % 2],
                    message(f"roll:globex:{i}", sender="news@globex.example"),
                    user="globex-app",
                    password=OTHER_PASSWORD,
                    sender="news@globex.example",
                )
                for i in range(TRIES)
            ]
        finally:
            await asyncio.to_thread(new.stop)
            await asyncio.to_thread(old.stop)
    keys = upstream.event_keys()
    assert sorted(k for k in keys if k.startswith("roll:acme")) == [f"roll:acme:{i}" for i in range(CAP)], (
        keys
    )
    assert sorted(k for k in keys if k.startswith("roll:globex")) == [f"roll:globex:{i}" for i in range(CAP)]
    assert [r.code for r in acme] == [250] * CAP + [451] * CAP, [str(r) for r in acme]
    assert all("user acme-app" in r.text for r in acme[CAP:]), [str(r) for r in acme]
    assert [r.code for r in globex] == [250] * CAP + [451] * CAP, [str(r) for r in globex]
    assert all("slot frees" in r.text for r in globex[CAP:]), [str(r) for r in globex]
