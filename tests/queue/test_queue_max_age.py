"""A queued message past its class's max_age is never sent (DESIGN.md §4a), also when the
max_age runs out after the worker claimed it: between the claim and the provider's
transaction an entry can wait for a connection of the provider's pool, connect, EHLO, AUTH.
Counted at the upstream."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from smtpguard.policy.limits import month_of
from tests.support import Behaviour, Upstream, base_config, message, running_guard, send
from tests.support.eventually import eventually


def one_connection_config(tmp: Path, port: int) -> dict[str, Any]:
    """Queue mode, a provider with a pool of one connection (so a second entry claimed while
    the first is in its DATA waits for it), an otp class that expires after 2 s."""
    cfg = base_config(
        tmp,
        port,
        zones__acme__delivery="queue",
        zones__acme__hourly_cap=100_000,
        zones__acme__monthly_cap=1_000_000,
    )
    cfg["providers"][0]["pool_size"] = 1
    cfg["providers"][0]["timeouts"] = {"connect": "2s", "command": "5s", "data": "20s"}
    cfg["queue"] = {
        "backoff": {"base": "100ms", "max": "500ms"},
        "workers": 4,
        "poll_interval": "100ms",
        "classes": {
            "otp": {"max_age": "2s", "priority": 0},
            "transactional": {"max_age": "3d", "priority": 1},
        },
    }
    return cfg


async def test_max_age_reached_while_waiting_for_the_provider_is_never_sent(
    tmp: Path, upstream: Upstream
) -> None:
    release = asyncio.Event()
    upstream.handler.script = [Behaviour(hold_after_dot=release)]
    cfg = one_connection_config(tmp, upstream.port)
    async with running_guard(cfg) as guard:
        store = guard.store
        assert store is not None
        first = await send(guard.ports[0], message("slow:1"))
        assert first.code == 250 and "queued as" in first.text
        # The first entry holds the pool's only connection in its DATA.
        await upstream.wait_received(1)
        code = await send(guard.ports[0], message("otp:1", headers={"X-Message-Class": "otp"}))
        assert code.code == 250 and "queued as" in code.text
        # Claimed at once (within its max_age), waiting for the connection.
        claimed = await eventually(
            lambda: store.get("acme", "otp:1"),
            lambda r: r is not None and r.state.value == "in_flight",
            timeout=5,
            interval=0.02,
        )
        assert claimed is not None and claimed.expires_at is not None
        expires_at = claimed.expires_at
        # Its max_age runs out on the store's clock while it waits.
        await eventually(store.now, lambda t: t > expires_at + 0.1, timeout=5, interval=0.05)
        release.set()
        rec = await eventually(
            lambda: store.get("acme", "otp:1"),
            lambda r: r is not None and r.state.value not in ("in_flight", "queued"),
            timeout=10,
            interval=0.02,
        )
        slow = await eventually(
            lambda: store.get("acme", "slow:1"),
            lambda r: r is not None and r.state.value == "delivered",
            timeout=10,
            interval=0.02,
        )
        assert slow is not None
        # Nothing more arrives, however long the worker keeps going.
        await eventually(
            lambda: store.get("acme", "otp:1"),
            lambda r: r is not None and r.state.value == "expired",
            timeout=5,
            interval=0.02,
        )
        # One unit for the one message that reached DATA: the expired entry's went back (the
        # refund is written after the record's `expired`, so a loaded machine reads between).
        usage = await eventually(
            lambda: store.cap_usage("acme", store.now(), month_of(store.now())),
            lambda u: u.hour <= 1 and u.month <= 1,
            timeout=5,
            interval=0.02,
        )
    keys = upstream.event_keys()
    assert usage.hour == 1 and usage.month == 1, usage
    assert upstream.handler.data_commands == 1
    assert keys == ["slow:1"], keys
    assert rec is not None and rec.state.value == "expired", rec
    assert not [a for a in rec.attempts if a.outcome == "delivered"]
    print(f"max_age between claim and DATA: upstream received {keys}, otp:1 {rec.state.value}")
