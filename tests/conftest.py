from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path

import pytest
import uvloop

from tests.support import RedisServer, Upstream
from tests.support import events as ev
from tests.support.hostile import assert_no_tracebacks
from tests.support.postgres import PostgresServer

# smtpguard runs on uvloop by default (event_loop: auto) and on asyncio's loop without the
# `fast` extra. The in-process tests of the wire (listener, DATA, STARTTLS, relay) run on both.
BOTH_LOOPS = frozenset(
    {
        "test_data_transfer.py",
        "test_e2e_relay.py",
        "test_hostile.py",
        "test_hostile_tls.py",
        "test_pipelining.py",
        "test_wire_attacks.py",
        "test_side_listener_attacks.py",
        "test_outsider_half_close.py",
        "test_outsider_pool.py",
    }
)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name in BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    yield up
    await up.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests use their own key prefixes or FLUSHALL."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL for the session, run as an unprivileged user on a loopback port;
    tests empty its tables (tests/postgres_support.reset) or use their own zones."""
    server = PostgresServer()
    server.init()
    server.start()
    yield server
    server.remove()


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails the test if anything, at any level, was logged with a traceback."""
    caplog.set_level(logging.DEBUG)
    yield
    assert_no_tracebacks(caplog.records)


@pytest.fixture
def keys(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> ev.Keys:
    """Every provider event source's secrets (tests/support/events.py), in the environment
    the config names them by. Test modules that define their own `keys` keep theirs."""
    k = ev.Keys.make(tmp)
    for name, value in k.env().items():
        monkeypatch.setenv(name, value)
    return k
