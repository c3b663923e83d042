"""Store-and-forward crash loop: `kill -9` during deliveries to a slow upstream, restart.
Counted at the upstream: of every message answered `250 queued`, none is sent twice and
none is lost (each is delivered once, or held as unknown for an operator)."""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter
from pathlib import Path

import aiosmtplib

from tests.support import (
    Behaviour,
    GuardProcess,
    Upstream,
    free_port,
    message,
    send,
    settled_records,
    write_config,
)
from tests.support.queue import killable_queue_config

ITERATIONS = 12
PER_ITERATION = 4


async def test_queue_mode_kill_9_loop(tmp: Path, upstream: Upstream) -> None:
    seed = int(os.environ.get("SMTPGUARD_CRASH_SEED", "20261129"))
    rng = random.Random(seed)
    upstream.handler.default = Behaviour(hang_after_dot=0.2)
    port = free_port()
    cfg = killable_queue_config(tmp, upstream.port, port)
    cfg["breaker"] = {"failure_threshold": 50, "cooldown": "1s"}
    path = write_config(tmp / "c.yaml", cfg)
    proc = GuardProcess(path, tmp / "guard.log")

    accepted: list[str] = []
    for i in range(ITERATIONS):
        proc.start()
        await proc.wait_port(port)
        for j in range(PER_ITERATION):
            key = f"qc:{i}:{j}"
            try:
                reply = await send(port, message(key), timeout=5)
            except (aiosmtplib.SMTPException, OSError):
                continue
            if reply.code == 250:
                accepted.append(key)
        await asyncio.sleep(rng.uniform(0.0, 0.6))
        proc.kill()

    # A last instance delivers everything still queued (claims of the dead return after
    # their lease), then stops.
    proc.start()
    await proc.wait_port(port)
    try:
        records = await settled_records(cfg["store"]["url"], "acme", accepted)
    finally:
        await proc.astop()

    counts = Counter(upstream.event_keys())
    states = Counter(r.state.value if r else "missing" for r in records.values())
    duplicates = {k: n for k, n in counts.items() if n > 1}
    lost = [
        k
        for k, r in records.items()
        if r is None
        or (r.state.value == "delivered" and counts[k] != 1)
        or r.state.value not in ("delivered", "unknown")
    ]
    print(
        f"queue crash loop seed={seed} iterations={ITERATIONS} accepted={len(accepted)} "
        f"delivered={states['delivered']} held_unknown={states['unknown']} "
        f"duplicates={len(duplicates)} lost={len(lost)}"
    )
    assert accepted
    assert duplicates == {}
    assert lost == []
    assert all(counts[k] <= 1 for k, r in records.items() if r and r.state.value == "unknown")
