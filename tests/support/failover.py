"""A submission storm across a store failover, and its count at the recording upstream.

Clients submit distinct keys as fast as they are answered and retry a key on any 4xx (or a
session cut) as a mail client does, until it gets a 250. `fail_over` runs mid-storm (it
kills the store's primary and promotes another). Once the storm has settled, every key
that got a 250 is submitted once more, as an application that re-sends an event does: a
store that forgot the event sends it again. Counted: duplicates (a key more than once at
the upstream), lost (a client 250 whose key never reached the upstream), held (keys never
answered 250: the ledger holds them, normally `unknown`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tests.support import Reply, Upstream, message, send


@dataclass
class StormCount:
    keys: int = 0
    before_failover: int = 0
    ok: set[str] = field(default_factory=set)
    held: list[str] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    upstream: int = 0
    first_250_after: float | None = None
    """Seconds from the end of fail_over to the first 250 after it."""
    replies: Counter[str] = field(default_factory=Counter)
    """Every reply other than 250, by code and enhanced code."""
    resent_answers: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        after = "never" if self.first_250_after is None else f"{self.first_250_after:.2f} s"
        return (
            f"{self.keys} keys, {self.before_failover} answered 250 before the failover, first 250 "
            f"after it {after}; {len(self.ok)} keys 250 at the client, {self.upstream} messages "
            f"upstream; duplicates {len(self.duplicates)}, lost {len(self.lost)}, held {len(self.held)} "
            f"{self.held[:20]}; other replies {dict(self.replies)}; every 250 key re-sent once → "
            f"{dict(self.resent_answers)}"
        )


def _label(reply: Reply) -> str:
    if reply.code == 0:
        return reply.text
    return f"{reply.code} {reply.text[:5]}"


async def storm(
    port: int,
    upstream: Upstream,
    fail_over: Callable[[], Awaitable[None]],
    *,
    workers: int = 16,
    before: float = 2.0,
    after: float = 4.0,
    settle: float = 10.0,
    prefix: str = "fo",
    drain: Callable[[], Awaitable[None]] | None = None,
    submit: Callable[[str], Awaitable[Reply]] | None = None,
) -> StormCount:
    """`drain`: awaited before counting what the upstream received (store-and-forward: until
    the queue is empty). `submit`: how a key is sent (its zone, its user); by default as
    acme-app in zone acme."""

    async def default_submit(key: str) -> Reply:
        return await send(port, message(key), timeout=60)

    submit_key = submit or default_submit
    count = StormCount()
    answered_at: dict[str, float] = {}
    open_keys: dict[str, list[Reply]] = {}
    next_key = 0
    accepting = True
    settle_by = float("inf")

    async def client() -> None:
        nonlocal next_key
        while accepting:
            key = f"{prefix}:{next_key}"
            next_key += 1
            open_keys[key] = []
            while time.monotonic() < settle_by:
                try:
                    reply = await submit_key(key)
                except Exception as e:  # a session cut mid-way: retried like a 4xx
                    reply = Reply(0, f"client error {type(e).__name__}")
                open_keys[key].append(reply)
                if reply.code == 250:
                    answered_at[key] = time.monotonic()
                    break
                count.replies[_label(reply)] += 1
                await asyncio.sleep(0.2)

    clients = [asyncio.create_task(client()) for _ in range(workers)]
    try:
        await asyncio.sleep(before)
        count.before_failover = len(answered_at)
        await fail_over()
        failed_over = time.monotonic()
        await asyncio.sleep(after)
        accepting = False
        settle_by = time.monotonic() + settle
        await asyncio.gather(*clients)
    finally:
        for c in clients:
            c.cancel()
    count.keys = len(open_keys)
    count.ok = {k for k, rs in open_keys.items() if rs and rs[-1].code == 250}
    count.held = sorted(k for k in open_keys if k not in count.ok)
    later = [t for t in answered_at.values() if t > failed_over]
    count.first_250_after = min(later) - failed_over if later else None
    # The application sends every event it was told was accepted once more.
    gate = asyncio.Semaphore(workers)

    async def resend(key: str) -> Reply:
        async with gate:
            return await submit_key(key)

    resent = await asyncio.gather(*(resend(k) for k in sorted(count.ok)))
    count.resent_answers = Counter(
        "250 duplicate" if r.code == 250 and "duplicate" in r.text else _label(r) for r in resent
    )
    if drain is not None:
        await drain()
    sent = Counter(upstream.event_keys())
    count.upstream = sum(sent.values())
    count.duplicates = {str(k): n for k, n in sent.items() if n > 1}
    count.lost = sorted(k for k in count.ok if sent[k] == 0)
    return count


async def store_away_while_the_dot_is_held(
    port: int,
    upstream: Upstream,
    held: asyncio.Event,
    stop: Callable[[], Awaitable[None]],
    start: Callable[[], Awaitable[None]],
    prefix: str,
) -> None:
    """The store goes away while the upstream holds its answer to a message's final dot
    (`held`, a Behaviour(hold_after_dot=…) the caller scripted), and is back a moment later.
    The held message's 250 is recorded (its retry is a duplicate); a new event submitted
    while the store is away is 451 4.3.0 and unsent, and sends once when retried after. The
    caller counts the upstream: `PREFIX:1`, `PREFIX:2`, each once."""
    first = asyncio.create_task(send(port, message(f"{prefix}:1"), timeout=60))
    await upstream.wait_received(1)
    await stop()
    held.set()
    during = await send(port, message(f"{prefix}:2"))
    assert str(during).startswith("451 4.3.0"), during
    await start()
    reply = await asyncio.wait_for(first, 60)
    assert reply.code == 250 and "queued as Q1" in reply.text, reply
    again = await send(port, message(f"{prefix}:1"))
    assert again.code == 250 and "duplicate" in again.text, again
    assert (await send(port, message(f"{prefix}:2"))).code == 250
    await upstream.wait_received(2)
