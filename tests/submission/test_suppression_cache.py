"""The in-memory suppression lists: exact against the store, refreshed by change counters."""

from __future__ import annotations

from pathlib import Path

from smtpguard.store.sqlite import SQLiteStore
from smtpguard.suppression import REFRESH, SuppressionCache


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_cache_follows_changes_made_elsewhere(tmp_path: Path) -> None:
    store = SQLiteStore(f"sqlite:///{tmp_path / 's.db'}")
    await store.open()
    clock = Clock()
    cache = SuppressionCache(store, clock)
    try:
        await store.suppress_add("acme", "Zed@Example.COM", "asked", 1.0)
        await store.suppress_add("global", "all@example.com", "asked", 1.0)
        assert await cache.find("acme", "Zed@example.com") == "acme"
        assert await cache.find("acme", "all@EXAMPLE.com") == "global"
        assert await cache.find("globex", "Zed@example.com") is None
        assert await cache.find("acme", "zed@example.com") == "acme"  # compared case-folded
        await store.suppress_remove("acme", "Zed@example.com")  # as the CLI would, elsewhere
        assert await cache.find("acme", "Zed@example.com") == "acme"  # within one refresh
        clock.t += REFRESH
        assert await cache.find("acme", "Zed@example.com") is None
        await store.suppress_add("acme", "new@example.com", "bounce", 2.0)
        cache.invalidate("acme")  # this instance made the change: at once
        assert await cache.find("acme", "new@example.com") == "acme"
    finally:
        await store.close()
