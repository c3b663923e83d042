"""Turns: one holder at a time per key, for the checks that must not run in parallel for
one client (an AUTH or a console login: a burst of parallel guesses must not all pass the
failure count before the first failure is written). A key's lock lives while someone holds
or awaits it, and is forgotten when nobody does, so a flood of keys keeps nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class _Turn:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.waiting = 0


class Turns:
    def __init__(self) -> None:
        self._by_key: dict[str, _Turn] = {}

    @contextlib.asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        turn = self._by_key.get(key)
        if turn is None:
            turn = self._by_key[key] = _Turn()
        turn.waiting += 1
        try:
            async with turn.lock:
                yield
        finally:
            turn.waiting -= 1
            if not turn.waiting:
                del self._by_key[key]

    def __len__(self) -> int:
        return len(self._by_key)
