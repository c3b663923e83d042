"""DESIGN.md §15: a store that may forget an acknowledged reservation turns a restart or an
eviction into a duplicate; serve refuses it unless the operator said `unsafe`."""

from __future__ import annotations

import asyncio
import logging

from smtpguard.store import Store, StoreUnavailable

log = logging.getLogger("smtpguard.server")


def refusals(problems: list[str], unsafe: bool) -> list[str]:
    """Why serve must not run on this store; empty when it may (logged when only `unsafe`
    lets it)."""
    if unsafe:
        for p in problems:
            log.warning("store may forget acknowledged writes (store.unsafe)", extra={"problem": p})
        return []
    return [f"store: {p}; fix it or set store.unsafe: true (see docs/stores.md)" for p in problems]


async def first_answer(store: Store) -> list[str]:
    """The store's durability problems, asked once a second until it answers (it was down
    at start: every submission meanwhile gets 451 4.3.0)."""
    while True:
        await asyncio.sleep(1.0)
        try:
            return await store.durability_problems()
        except StoreUnavailable:
            continue
