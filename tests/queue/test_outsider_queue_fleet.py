"""Store-and-forward from outside, two instances at once: both accept and both drain one
queue on one shared store (PostgreSQL, Redis), while duplicates of the events arrive at the
other instance and one instance is killed with `kill -9` mid-drain and started again.
Counted at the upstream: every event answered `250` reaches it at most once, and every one
is delivered or held unknown for an operator."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiosmtplib
import pytest

from tests.support import (
    Behaviour,
    GuardProcess,
    RedisServer,
    Upstream,
    free_port,
    message,
    send,
    settled_records,
    write_config,
)
from tests.support.postgres import PostgresServer, reset
from tests.support.queue import killable_queue_config

MESSAGES = 40


@pytest.fixture(params=["postgres", "redis"])
def store_url(request: pytest.FixtureRequest, tmp: Path) -> Iterator[str]:
    if request.param == "postgres":
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        reset(pg.url)
        yield pg.url
        return
    redis = RedisServer(tmp, durable=True)
    redis.start()
    try:
        yield redis.url
    finally:
        redis.stop()


async def offer(port: int, key: str) -> int | None:
    try:
        return (await send(port, message(key), timeout=5)).code
    except (aiosmtplib.SMTPException, OSError):
        return None


async def test_two_instances_draining_one_queue_send_each_event_once(
    tmp: Path, upstream: Upstream, store_url: str
) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=0.1)
    guards: list[GuardProcess] = []
    ports: list[int] = []
    for name in ("a", "b"):
        port = free_port()
        cfg = killable_queue_config(
            tmp, upstream.port, port, store_url=store_url, instance=name, poll_interval="50ms"
        )
        guards.append(GuardProcess(write_config(tmp / f"{name}.yaml", cfg), tmp / f"{name}.log"))
        ports.append(port)
    a = guards[0]
    try:
        for g, port in zip(guards, ports, strict=True):
            g.start()
            await g.wait_port(port)
        keys = [f"fleet:{i}" for i in range(MESSAGES)]
        # Each event offered to both instances at once: one accepts, the other answers from
        # the shared ledger (a duplicate, or 451 while the first holds it).
        codes = await asyncio.gather(
            *(offer(ports[i % 2], k) for i, k in enumerate(keys)),
            *(offer(ports[(i + 1) % 2], k) for i, k in enumerate(keys)),
        )
        accepted = sorted({k for k, c in zip(keys + keys, codes, strict=True) if c == 250})
        await upstream.wait_received(MESSAGES // 4)
        a.kill()  # mid-drain: some delivered, some on the wire, some claimed, most queued
        # Duplicates of every event again at the survivor while it drains.
        again = await asyncio.gather(*(offer(ports[1], k) for k in keys))
        a.start()
        await a.wait_port(ports[0])
        records = await settled_records(store_url, "acme", accepted)
    finally:
        for g in guards:
            await g.astop()

    counts = Counter(upstream.event_keys())
    states = Counter(r.state.value if r else "missing" for r in records.values())
    twice = {k: n for k, n in counts.items() if n > 1}
    print(
        f"fleet drain: accepted={len(accepted)} upstream={sum(counts.values())} states={dict(states)} "
        f"twice={twice} replies={Counter(codes)} again={Counter(again)}"
    )
    assert len(accepted) == MESSAGES
    assert twice == {}
    assert states["delivered"] + states["unknown"] == MESSAGES
    assert all(counts[k] == 1 for k, r in records.items() if r and r.state.value == "delivered")
    assert set(counts) <= set(accepted)
