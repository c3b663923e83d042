"""One way for a test to wait for something that is about to happen: ask again, bounded in time.

`eventually` returns the last value it saw, whether or not it held, so the caller's own assert
says what was expected and shows what was there. It never stands in for a negative check
("nothing arrived"): that waits on a positive event first, then looks once.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T]] | Callable[[], T],
    until: Callable[[T], object] = bool,
    *,
    timeout: float,
    interval: float,
) -> T:
    """Call `probe` (sync or async) until `until(value)` is true or `timeout` seconds have
    passed, sleeping `interval` between calls; return the last value. Always probes once."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        value = cast(T, await result if inspect.isawaitable(result) else result)
        if until(value) or time.monotonic() >= deadline:
            return value
        await asyncio.sleep(interval)
