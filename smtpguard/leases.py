"""Lease renewal for every relay in progress, from one task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("smtpguard.decision")


class LeaseLost(Exception):
    """Another submission took the key over while this one relayed; stop before DATA."""


@dataclass(slots=True)
class _Held:
    renew: Callable[[], Awaitable[None]]
    every: float
    renewed_at: float
    running: asyncio.Task[None] | None = None


class LeaseKeeper:
    """Renews the lease of every relay in progress, from one task.

    A relay longer than a third of its lease gets its lease renewed; most relays end long
    before that. One task for all of them, rather than a task and a timer created and
    cancelled per message, which cost a measurable share of the event loop under load. Each
    renewal runs on its own, so one slow store call delays no other relay's renewal."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[int, _Held] = {}
        self._next = 0
        self._task: asyncio.Task[None] | None = None
        self._tick = math.inf
        """The wait the task is in now; hold() compares against it, never scans every relay."""
        self._sooner = asyncio.Event()

    def hold(self, renew: Callable[[], Awaitable[None]], lease: float) -> int:
        """Renew every lease/3 until release(); `renew` raising LeaseLost ends the renewals."""
        every = lease / 3
        self._next += 1
        self._held[self._next] = _Held(renew, every, self._clock())
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        elif every / 2 < self._tick:
            self._sooner.set()  # a shorter lease (after a reload): look again sooner
        return self._next

    def release(self, handle: int) -> None:
        """Stop renewing; a renewal in progress is cancelled (the outcome write that follows
        supersedes it, and a renewal that landed anyway only makes that write retry)."""
        held = self._held.pop(handle, None)
        if held is not None and held.running is not None:
            held.running.cancel()

    async def close(self) -> None:
        tasks = [h.running for h in self._held.values() if h.running is not None]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self) -> None:
        while self._held:
            # A sixth of the shortest lease: every lease is renewed within half its length.
            self._tick = min(h.every for h in self._held.values()) / 2
            self._sooner.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sooner.wait(), self._tick)
            now = self._clock()
            for handle, held in list(self._held.items()):
                if now - held.renewed_at >= held.every and (held.running is None or held.running.done()):
                    held.renewed_at = now
                    held.running = asyncio.create_task(self._renew(handle, held))

    async def _renew(self, handle: int, held: _Held) -> None:
        try:
            await held.renew()
        except LeaseLost:
            if self._held.get(handle) is held:
                del self._held[handle]
        except Exception as e:
            # A renewal that fails must never cost the outcome of the relay it guards.
            log.warning("lease renewal failed", extra={"error": str(e)})
