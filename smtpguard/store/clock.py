"""The store's clock (DESIGN.md §11.5): the server's clock, sampled now and then and carried
forward between samples on this process's monotonic clock.

Every instance measures leases on the same clock, so a host whose wall clock is minutes off
neither expires another's live lease nor keeps a dead one alive. The error is half a round
trip at a sample plus monotonic drift since (ppm): far below a lease. The monotonic clock
never steps, so neither does this; a new sample never moves it backwards, even when a
failover brings a server whose clock differs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from smtpguard.store.base import StoreUnavailable

SAMPLE_EVERY = 10.0
"""How often the server's clock is sampled to follow drift between its clock and ours."""


class ServerClock:
    def __init__(self) -> None:
        self.mono: Callable[[], float] = time.monotonic
        self.offset: float | None = None
        """The server's clock minus this process's monotonic clock, from the last sample."""
        self._last_now = 0.0

    def now(self) -> float:
        """The server's clock; this host's wall clock until the first sample."""
        if self.offset is None:
            return time.time()
        t = self.mono() + self.offset
        if t < self._last_now:
            return self._last_now
        self._last_now = t
        return t

    async def sample(self, read: Callable[[], Awaitable[float]]) -> None:
        """One sample: `read()` answers the server's time, taken as of the round trip's middle."""
        before = self.mono()
        server = await read()
        after = self.mono()
        self.offset = server - (before + after) / 2

    async def track(self, sync: Callable[[], Awaitable[None]]) -> None:
        """Runs `sync` (a store's sample, StoreUnavailable when the server is away) forever."""
        while True:
            # Until the first sample (the server was down at open) this instance runs on its
            # own clock: look again soon, not in ten seconds.
            await asyncio.sleep(SAMPLE_EVERY if self.offset is not None else 0.2)
            with contextlib.suppress(StoreUnavailable):
                await sync()


class OnServerClock:
    """A store whose now() is its server's clock (set `_clock` in its __init__)."""

    _clock: ServerClock

    def now(self) -> float:
        """The server's clock (ServerClock.now): every instance measures leases on it."""
        return self._clock.now()

    @property
    def _mono(self) -> Callable[[], float]:
        """This process's monotonic clock, as the store's clock reads it (tests step it)."""
        return self._clock.mono

    @_mono.setter
    def _mono(self, mono: Callable[[], float]) -> None:
        self._clock.mono = mono
