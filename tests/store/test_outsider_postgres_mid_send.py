"""PostgreSQL crashes (`pg_ctl stop -m immediate`: no shutdown checkpoint, every backend cut)
while the upstream holds its answer to a message's final dot, and is back a moment later.
Counted at the upstream: that message once, its retry a duplicate; a submission made
while the server is down gets 451 4.3.0 and sends nothing, then sends once. A server of
its own (the session's is shared), real clients, a real recording upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.store.test_postgres_upgrade import config_for, database
from tests.support import Behaviour, Upstream, running_guard
from tests.support.failover import store_away_while_the_dot_is_held
from tests.support.postgres import PostgresServer


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    server = PostgresServer(name="crash")
    server.init()
    server.start()
    yield server
    server.remove()


async def test_postgres_crashed_while_the_upstream_holds_the_dot_sends_the_event_once(
    tmp: Path, upstream: Upstream, own_postgres: PostgresServer
) -> None:
    url = database(own_postgres, "sg_crash")
    cfg = config_for(tmp, upstream.port, url, "crash", 0)
    cfg["event_key"]["lease"] = "2s"
    cfg["event_key"]["inflight_wait"] = "1s"
    held = asyncio.Event()
    upstream.handler.script.append(Behaviour(hold_after_dot=held))
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        await store_away_while_the_dot_is_held(
            port,
            upstream,
            held,
            lambda: asyncio.to_thread(own_postgres.stop),
            lambda: asyncio.to_thread(own_postgres.start),
            "pgc",
        )
    assert upstream.event_keys() == ["pgc:1", "pgc:2"]
