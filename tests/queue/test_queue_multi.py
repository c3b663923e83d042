"""Store-and-forward across instances on one Redis: what instance A accepted, instance B
delivers after A is killed with `kill -9`; nothing twice, nothing lost."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

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
from tests.support.queue import killable_queue_config

MESSAGES = 30


async def test_instance_b_delivers_what_killed_instance_a_accepted(tmp: Path, upstream: Upstream) -> None:
    redis = RedisServer(tmp, durable=True)
    redis.start()
    upstream.handler.default = Behaviour(hang_after_dot=0.3)
    guards: list[GuardProcess] = []
    ports: list[int] = []
    try:
        for name in ("a", "b"):
            port = free_port()
            cfg = killable_queue_config(
                tmp, upstream.port, port, store_url=redis.url, instance=name, workers=2
            )
            path = write_config(tmp / f"{name}.yaml", cfg)
            guards.append(GuardProcess(path, tmp / f"{name}.log"))
            ports.append(port)
        a, b = guards
        a.start()
        await a.wait_port(ports[0])
        replies = await asyncio.gather(*(send(ports[0], message(f"m{i}")) for i in range(MESSAGES)))
        accepted = [f"m{i}" for i, r in enumerate(replies) if r.code == 250]
        assert len(accepted) == MESSAGES
        await upstream.wait_received(2)
        a.kill()  # mid-delivery: some sent, some on the wire, most still queued
        sent_by_a = len(upstream.received)
        b.start()
        await b.wait_port(ports[1])
        # Duplicates submitted to B while it delivers are answered from the shared ledger.
        dups = await asyncio.gather(*(send(ports[1], message(k)) for k in accepted[::5]))
        assert all(d.code in (250, 451) for d in dups)
        records = await settled_records(redis.url, "acme", accepted)
        await b.astop()
    finally:
        for g in guards:
            g.kill()
        redis.stop()

    counts = Counter(upstream.event_keys())
    states = Counter(r.state.value if r else "missing" for r in records.values())
    delivered_by_b = [
        r
        for r in records.values()
        if r and r.attempts and r.attempts[-1].instance == "b" and r.state.value == "delivered"
    ]
    print(
        f"queue multi-instance: accepted by a={len(accepted)} sent before kill={sent_by_a} "
        f"delivered by b={len(delivered_by_b)} states={dict(states)} "
        f"duplicates={sum(1 for n in counts.values() if n > 1)}"
    )
    assert all(n == 1 for n in counts.values())
    assert states["delivered"] + states["unknown"] == MESSAGES
    assert all(counts[k] == 1 for k, r in records.items() if r and r.state.value == "delivered")
    assert len(delivered_by_b) >= MESSAGES - sent_by_a - 2
