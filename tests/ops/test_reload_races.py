"""A reload and a stop that meet (a deploy script's SIGHUP just before its SIGTERM): the reload
under way when stop begins finishes before anything is torn down, so what it starts (here the
first verdict loop, which a reload starts once a provider has an `api`) is stopped with the
rest; a reload asked for once stop has begun is refused; a second stop waits for the first.
A real listener, upstream sink, SQLite store and fake SendGrid log; the clock is injected and
the upstream is counted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from smtpguard.server import reload as reloading
from tests.support import Upstream, message, send, write_config
from tests.support.eventually import eventually
from tests.support.verdicts import verdict_harness


@pytest.fixture
def store_url(tmp: Path) -> str:
    return f"sqlite:///{tmp / 'state.db'}"


def _verdict_loops() -> int:
    return sum(
        1
        for t in asyncio.all_tasks()
        if not t.done() and getattr(t.get_coro(), "__qualname__", "") == "VerdictLoop.run"
    )


class CountedLock(asyncio.Lock):
    """The server's reload lock, counting who asked for it: the test knows that stop is
    waiting on it without waiting for a time to pass."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def acquire(self) -> bool:
        self.asked += 1
        return await super().acquire()


async def test_stop_waits_for_the_reload_under_way_and_stops_what_it_started(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with verdict_harness(tmp, upstream, store_url, monkeypatch, "sendgrid", api=False) as h:
        guard = h.guard
        assert (await send(guard.ports[0], message("before"))).code == 250
        assert guard.verdicts is None and _verdict_loops() == 0
        lock = CountedLock()
        monkeypatch.setattr(guard, "_reloading", lock)
        # The reload is held at its last await before it starts the verdict loop, as a slow
        # console restart or a slow close of the old upstream connections would hold it.
        entered, release = asyncio.Event(), asyncio.Event()
        console = reloading.reload_console

        async def held(*args: Any) -> Any:
            entered.set()
            await release.wait()
            return await console(*args)

        monkeypatch.setattr(reloading, "reload_console", held)
        h.cfg["providers"][0]["api"] = h.api
        assert h.path is not None
        write_config(h.path, h.cfg)
        reload = asyncio.create_task(guard.reload())
        await asyncio.wait_for(entered.wait(), 10)
        stop = asyncio.create_task(guard.stop())
        await eventually(lambda: lock.asked == 2 or stop.done(), timeout=10, interval=0.01)
        assert not stop.done(), "stop tore the instance down while a reload was still applying"
        assert guard.draining and guard.store is not None
        release.set()
        assert await reload
        assert guard.verdicts is not None  # the reload, finished, started the loop
        await stop
        assert _verdict_loops() == 0  # …and stop, which waited for it, stopped it
    assert upstream.event_keys() == ["before"]


async def test_a_reload_asked_for_once_stop_has_begun_is_refused(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    async with verdict_harness(tmp, upstream, store_url, monkeypatch, "sendgrid", api=False) as h:
        guard = h.guard
        h.cfg["providers"][0]["api"] = h.api
        assert h.path is not None
        write_config(h.path, h.cfg)
        stop = asyncio.create_task(guard.stop())
        await eventually(lambda: guard.draining, timeout=10, interval=0.01)
        assert not await guard.reload()
        await stop
        assert guard.verdicts is None and _verdict_loops() == 0
        # A second stop (the harness's own, or a SIGTERM heard twice) waits for the first
        # and tears nothing down twice.
        await asyncio.wait_for(guard.stop(), 10)
    assert "reload refused: stopping" in caplog.text
    assert upstream.event_keys() == []


async def test_a_wedged_reload_keeps_stop_waiting_no_longer_than_drain_timeout(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    async with verdict_harness(
        tmp, upstream, store_url, monkeypatch, "sendgrid", api=False, limits__drain_timeout=0.5
    ) as h:
        guard = h.guard
        entered, never = asyncio.Event(), asyncio.Event()

        async def wedged(*args: Any) -> Any:
            entered.set()
            await never.wait()

        monkeypatch.setattr(reloading, "reload_console", wedged)
        reload = asyncio.create_task(guard.reload())
        await asyncio.wait_for(entered.wait(), 10)
        await asyncio.wait_for(guard.stop(), 10)
        assert guard.verdicts is None and _verdict_loops() == 0
        reload.cancel()
    assert "stopping while a reload is still under way" in caplog.text
