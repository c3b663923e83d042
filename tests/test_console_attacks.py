"""Attacks on the console's login limits and sessions (DESIGN.md §18, "The console") that
the trust tests did not try: a store that answers reads but refuses writes, addresses an
attacker holds by the million, and the replay of a session cookie. Real clients from
loopback addresses, a real console, a real redis-server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.console_support import PASSWORDS, Operator, console_config, console_port
from tests.support import RedisServer, Upstream, running_guard
from tests.utf8_support import store_overrides

LIMITS = {"auth_failures": 3, "auth_failure_window": "5m"}


@pytest.fixture(params=["redis"])
def redis_store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=11)


async def attempt(port: int, username: str, password: str, source: str) -> int:
    op = Operator(port, source=source)
    try:
        return (await op.login(username, password)).status
    finally:
        await op.close()


async def test_a_store_that_refuses_writes_never_lets_a_guess_go_uncounted(
    tmp: Path, upstream: Upstream, redis_store: dict[str, Any], redis_server: RedisServer
) -> None:
    """Redis refusing writes but answering reads (min-replicas-to-write with no replica; a
    full maxmemory under noeviction, a demoted primary do the same): every wrong password
    was answered 503 and never counted, the right one logged in: unlimited guessing with
    an oracle. A login the limiter cannot count must not be tried at all."""
    cfg = console_config(tmp, upstream, limits=LIMITS, **redis_store)
    admin = redis.Redis.from_url(redis_server.url)
    async with running_guard(cfg) as guard:
        port = console_port(guard)
        admin.config_set("min-replicas-to-write", 1)
        try:
            statuses = [await attempt(port, "alice", f"guess-{n}", "127.0.0.2") for n in range(6)]
            right = await attempt(port, "alice", PASSWORDS["alice"], "127.0.0.2")
        finally:
            admin.config_set("min-replicas-to-write", 0)
            admin.close()
        # Nothing is learnt while nothing can be counted: the right password is answered
        # as the wrong ones are.
        assert set(statuses) == {503} and right == 503, (statuses, right)
        # Once writes work again, nothing from that time was a free guess the limit missed,
        # and the limit still holds.
        for n in range(3):
            assert await attempt(port, "alice", f"later-{n}", "127.0.0.3") == 401
        assert await attempt(port, "alice", PASSWORDS["alice"], "127.0.0.4") == 429
