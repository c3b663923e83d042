"""The reconciliation cursor of DESIGN.md §19 on each of the three stores: absent until first
advanced, moved only by a caller that read it as it still is (one winner among racers), and
kept across a restart of the store."""

from __future__ import annotations

import asyncio

from smtpguard.store import Store, store_from_url
from tests.store.test_store_contract import NOW, store  # noqa: F401 - the three-backend fixture


async def test_the_cursor_moves_by_compare_and_swap(store: Store) -> None:  # noqa: F811
    name = "reconcile:primary"
    assert await store.reconcile_cursor(name) is None
    assert await store.advance_reconcile_cursor(name, None, NOW)
    assert not await store.advance_reconcile_cursor(name, None, NOW + 1)  # someone set it first
    assert await store.reconcile_cursor(name) == NOW
    assert not await store.advance_reconcile_cursor(name, NOW - 5, NOW + 2)  # a stale reading
    assert await store.advance_reconcile_cursor(name, NOW, NOW + 900.25)
    assert await store.reconcile_cursor(name) == NOW + 900.25
    assert await store.reconcile_cursor("reconcile:standby") is None  # one cursor per API


async def test_of_racing_instances_one_advances(store: Store) -> None:  # noqa: F811
    name = "reconcile:race"
    assert await store.advance_reconcile_cursor(name, None, NOW)
    won = await asyncio.gather(*(store.advance_reconcile_cursor(name, NOW, NOW + 1 + i) for i in range(12)))
    assert won.count(True) == 1
    assert await store.reconcile_cursor(name) == NOW + 1 + won.index(True)


async def test_the_cursor_survives_a_restart(store: Store) -> None:  # noqa: F811
    assert await store.advance_reconcile_cursor("reconcile:primary", None, NOW + 0.125)
    url = store_url(store)
    await store.close()
    again = store_from_url(url)
    await again.open()
    try:
        assert await again.reconcile_cursor("reconcile:primary") == NOW + 0.125
    finally:
        await again.close()
    await store.open()  # the fixture closes it


def store_url(s: Store) -> str:
    url = getattr(s, "url", None)
    if isinstance(url, str):
        return url
    return f"sqlite:///{s.path}"  # type: ignore[attr-defined]
