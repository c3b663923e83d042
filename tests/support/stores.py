"""An empty store of each backend, for the tests that take a store object to themselves."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis

from smtpguard.store import store_from_url
from tests.support import RedisServer
from tests.support.postgres import PostgresServer, reset


async def empty_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty store of the backend `request.param` names: a new SQLite file,
    the session's PostgreSQL with every table emptied, or the session's redis-server flushed."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    if request.param == "postgres":
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        first = store_from_url(pg.url)
        await first.open()  # the schema, so that there are tables to empty
        await first.close()
        reset(pg.url)
        return pg.url
    assert request.param == "redis", request.param
    server: RedisServer = request.getfixturevalue("redis_server")
    plain = aioredis.Redis.from_url(server.url)
    await plain.flushall()
    await plain.aclose()
    return server.url
