"""Redis goes away in the middle of a send, as an outsider who can crash or restart the store
would arrange it: the upstream has the message and holds its answer to the final dot while
redis-server is stopped, then answers 250. Counted at the upstream: the message is there
once, its event is never sent again (not while Redis is down, not after it is back), and a
submission that starts while Redis is down sends nothing. A real redis-server with the
durability docs/redis.md asks for (appendonly, appendfsync always), a real recording
upstream, real clients."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import Behaviour, RedisServer, Upstream, base_config, message, running_guard, send
from tests.support.failover import store_away_while_the_dot_is_held


def _config(tmp: Path, upstream: Upstream, redis: RedisServer) -> dict[str, Any]:
    cfg = base_config(tmp, upstream.port, store={"url": redis.url})
    cfg["event_key"]["lease"] = "2s"
    cfg["event_key"]["inflight_wait"] = "1s"
    return cfg


async def test_redis_restarted_while_the_upstream_holds_the_dot_sends_the_event_once(
    tmp: Path, upstream: Upstream
) -> None:
    """Redis is back within the outcome's retry budget: the held message's 250 is recorded,
    its retry is a duplicate; a new event submitted during the outage is 451 4.3.0, unsent,
    and sends once when retried after."""
    redis = RedisServer(tmp, durable=True)
    redis.start()
    held = asyncio.Event()
    upstream.handler.script.append(Behaviour(hold_after_dot=held))
    try:
        async with running_guard(_config(tmp, upstream, redis)) as guard:
            port = guard.ports[0]
            await store_away_while_the_dot_is_held(
                port,
                upstream,
                held,
                lambda: asyncio.to_thread(redis.stop),
                lambda: asyncio.to_thread(redis.start),
                "mid",
            )
    finally:
        redis.stop()
    assert upstream.event_keys() == ["mid:1", "mid:2"]


@pytest.mark.slow
async def test_redis_down_past_the_outcome_budget_leaves_the_event_unknown_never_resent(
    tmp: Path, upstream: Upstream
) -> None:
    """Redis stays down longer than the outcome's retry budget (about 30 s): the client gets
    the upstream's 250 when the budget is spent, the record reads `unknown` once its lease
    has run out, and retries after Redis is back are held (451 4.3.0), never sent again."""
    redis = RedisServer(tmp, durable=True)
    redis.start()
    held = asyncio.Event()
    upstream.handler.script.append(Behaviour(hold_after_dot=held))
    retries: list[str] = []
    try:
        async with running_guard(_config(tmp, upstream, redis)) as guard:
            port = guard.ports[0]
            first = asyncio.create_task(send(port, message("mid:1"), timeout=120))
            await upstream.wait_received(1)
            redis.stop()
            started = time.monotonic()
            held.set()
            reply = await asyncio.wait_for(first, 120)
            assert reply.code == 250 and "queued as Q1" in reply.text, reply
            assert time.monotonic() - started > 20  # answered only once the budget was spent
            redis.start()
            for _ in range(3):
                retries.append(str(await send(port, message("mid:1"))))
                await asyncio.sleep(1)
    finally:
        redis.stop()
    assert upstream.event_keys() == ["mid:1"], retries
    assert all(r.startswith("451 4.3.0") for r in retries), retries
    assert "unknown" in retries[-1], retries
