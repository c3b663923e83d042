"""Store-and-forward with the store killed mid-send: the worker's entry has its data_sent
note, the upstream has the message and holds its answer to the final dot, and redis-server
is killed with `kill -9` (appendfsync always), then started again from its AOF — once
within the claim's lease, once well past it (another claim then finds the entry in flight
after its dot). Counted at the upstream: the event is there once and never sent again;
its duplicates are answered 250 from the ledger; its record ends delivered, or unknown
(held for an operator), never queued again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smtpguard.store import Store
from tests.support import Behaviour, RedisServer, Upstream, message, running_guard, send
from tests.support.eventually import eventually
from tests.support.queue import killable_queue_config


@contextlib.asynccontextmanager
async def _held_on_redis(
    tmp: Path, upstream: Upstream
) -> AsyncIterator[tuple[int, Store, RedisServer, asyncio.Event]]:
    """A queue-mode guard on a durable redis-server whose upstream holds its answer to the
    first final dot until the event is set: the guard's port, its store, the server, the
    event."""
    redis = RedisServer(tmp, durable=True)
    redis.start()
    held = asyncio.Event()
    upstream.handler.script.append(Behaviour(hold_after_dot=held))
    cfg = killable_queue_config(tmp, upstream.port, 0, store_url=redis.url, poll_interval="50ms")
    try:
        async with running_guard(cfg) as guard:
            assert guard.store is not None and redis.proc is not None
            yield guard.ports[0], guard.store, redis, held
    finally:
        redis.stop()


@pytest.mark.parametrize("down_for", [0.2, 3.0])
async def test_redis_killed_between_the_note_and_the_outcome_sends_the_entry_once(
    tmp: Path, upstream: Upstream, down_for: float
) -> None:
    async with _held_on_redis(tmp, upstream) as (port, store, redis, held):
        accepted = await send(port, message("qmid:1"))
        assert accepted.code == 250 and "queued as" in accepted.text
        await upstream.wait_received(1)
        noted = await store.get("acme", "qmid:1")
        assert noted is not None and noted.phase is not None and noted.phase.value == "data_sent"
        assert redis.proc is not None
        redis.proc.kill()  # kill -9: only what the AOF has survives
        redis.proc.wait()
        held.set()  # the upstream answers 250 while the store is away
        await asyncio.sleep(down_for)
        await asyncio.to_thread(redis.start)
        # The owner has the upstream's 250 and keeps writing it until the store answers:
        # if a claim found the entry in flight after its lease meanwhile (unknown), the
        # owner's report settles it all the same.
        rec = await eventually(
            lambda: store.get("acme", "qmid:1"),
            lambda r: r is not None and r.state.value == "delivered",
            timeout=40,
            interval=0.05,
        )
        # However long the worker keeps claiming, the entry is not tried again.
        dups = [await send(port, message("qmid:1")) for _ in range(3)]
        entries = await store.queue_entries("acme")
        final = await store.get("acme", "qmid:1")
    keys = upstream.event_keys()
    print(
        f"redis down {down_for}s mid-send: upstream {keys}, record {final and final.state.value}, "
        f"duplicates {[str(d) for d in dups]}"
    )
    assert keys == ["qmid:1"] and upstream.handler.data_commands == 1
    assert rec is not None and final is not None
    assert final.state.value == "delivered", final
    assert all(d.code == 250 and "duplicate" in d.text for d in dups), dups
    assert [e.key for e in entries if e.due_at is not None] == []


async def test_a_hung_redis_answers_451_at_acceptance_and_sends_nothing_twice(
    tmp: Path, upstream: Upstream
) -> None:
    """redis-server stopped (SIGSTOP: connections accepted, nothing answered) while the
    upstream holds a queued entry's dot and while a new message is submitted: the new one is
    answered 451 4.3.0 at the store's deadline (its enqueue may have landed or not), the held
    one's 250 is recorded once Redis answers again (past the claim's lease), and a retry of
    each sends nothing twice."""
    async with _held_on_redis(tmp, upstream) as (port, store, redis, held):
        assert (await send(port, message("hung:1"))).code == 250
        await upstream.wait_received(1)
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            held.set()
            during = await send(port, message("hung:2"), timeout=30)
            await asyncio.sleep(1.5)  # past the claim's 1 s lease, on any clock
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        retried = await eventually(
            lambda: send(port, message("hung:2")), lambda r: r.code == 250, timeout=20, interval=0.2
        )
        for key in ("hung:1", "hung:2"):
            await eventually(
                lambda key=key: store.get("acme", key),
                lambda r: r is not None and r.state.value == "delivered",
                timeout=40,
                interval=0.05,
            )
        again = [await send(port, message(k)) for k in ("hung:1", "hung:2")]
    keys = upstream.event_keys()
    print(f"hung redis: during {during}, retried {retried}, again {[str(a) for a in again]}, upstream {keys}")
    assert (during.code, during.text.split()[0]) == (451, "4.3.0"), during
    assert sorted(keys) == ["hung:1", "hung:2"]
    assert all(a.code == 250 and "duplicate" in a.text for a in again), again
