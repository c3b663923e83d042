"""Tasks started and not awaited where they start (a release, a publish, a reload)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def keep(tasks: set[asyncio.Task[T]], coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Start `coro` as a task held in `tasks` until it is done. The event loop holds a task
    only weakly, so one that nobody holds may vanish half done; and a stop waits on `tasks`."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
