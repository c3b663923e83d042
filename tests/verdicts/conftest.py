"""What verdict tests share: the stores they run on (a real SQLite file, or a database of
its own on the session's real redis-server), and the provider log APIs (real HTTP servers,
tests/support/provider_api_fakes.py) on the clock a module names as `api_clock`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from tests.support.provider_api_fakes import FakeMailgun, FakePostmark, FakeSendgrid
from tests.support.utf8 import store_overrides

KEY = "key-3ax6xnjp29jd6fds4gc373sgvjxteol0"


class Now:
    """The wall clock every party shares: the fake's visibility, the client, the verdict."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp: Path) -> Iterator[str]:
    for overrides in store_overrides(request, tmp, redis_db=12):
        yield overrides["store__url"]


@pytest.fixture
def now() -> Now:
    return Now()


@pytest.fixture
def api_clock(now: Now) -> Callable[[], float]:
    """The clock the fake APIs keep their logs by (a module overrides it with its own)."""
    return now


@pytest.fixture
async def mailgun(api_clock: Callable[[], float]) -> AsyncIterator[FakeMailgun]:
    fake = FakeMailgun(KEY, "mg.acme.example", api_clock)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def postmark(api_clock: Callable[[], float]) -> AsyncIterator[FakePostmark]:
    fake = FakePostmark(KEY, api_clock)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def sendgrid(api_clock: Callable[[], float]) -> AsyncIterator[FakeSendgrid]:
    fake = FakeSendgrid(KEY, api_clock)
    await fake.start()
    yield fake
    await fake.stop()
