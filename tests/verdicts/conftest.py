"""The stores verdict tests run on: a real SQLite file, the session's real redis-server and,
where a test asks for it, the session's real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.support import RedisServer


@pytest.fixture(params=["sqlite", "redis"])
async def store_url(request: pytest.FixtureRequest, tmp: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp / 'state.db'}"
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    plain = aioredis.Redis.from_url(server.url)
    await plain.flushall()
    await plain.aclose()
    yield server.url
