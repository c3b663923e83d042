"""The hourly purge and the store-and-forward queue (DESIGN.md §4, §11.2): a message answered
`250 queued` whose next try lies further off than `event_key.retention` is still delivered
once, not purged with its record. Counted at the upstream."""

from __future__ import annotations

from pathlib import Path

from tests.support import Behaviour, FakeClock, Upstream, base_config, message, running_guard, send
from tests.support.eventually import eventually

DAY = 86400.0


async def test_a_deferred_entry_waiting_longer_than_the_retention_is_delivered_once(
    tmp: Path, upstream: Upstream
) -> None:
    upstream.handler.script = [Behaviour(data="451 4.3.0 try again later")]
    cfg = base_config(
        tmp,
        upstream.port,
        zones__acme__delivery="queue",
        zones__acme__hourly_cap=100_000,
        zones__acme__monthly_cap=1_000_000,
    )
    cfg["event_key"]["retention"] = "7d"
    # A class kept for two months, retried after 10 to 20 days (equal jitter on 20 days).
    cfg["queue"] = {
        "backoff": {"base": "20d", "max": "20d"},
        "poll_interval": "50ms",
        "default_class": "statements",
        "classes": {"statements": {"max_age": "60d", "priority": 0}},
    }
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        store = guard.store
        assert store is not None
        reply = await send(guard.ports[0], message("statement:2026-11"))
        assert reply.code == 250 and "queued as" in reply.text
        deferred = await eventually(
            lambda: store.get("acme", "statement:2026-11"),
            lambda r: r is not None and r.state.value == "deferred",
            timeout=5,
            interval=0.02,
        )
        assert deferred is not None and deferred.next_attempt_at is not None
        assert deferred.next_attempt_at >= clock() + 10 * DAY
        # Eight days on: past the retention since its last write, not yet due.
        clock.t += 8 * DAY
        await store.purge(clock(), 7 * DAY)
        kept = await store.get("acme", "statement:2026-11")
        clock.t = deferred.next_attempt_at + 1
        rec = await eventually(
            lambda: store.get("acme", "statement:2026-11"),
            lambda r: r is not None and r.state.value == "delivered",
            timeout=5,
            interval=0.02,
        )
    keys = upstream.event_keys()
    print(f"deferred past the retention: kept={kept is not None}, upstream received {keys}")
    # Before: purged with its record, never tried again (upstream: one 451, nothing else).
    assert keys == ["statement:2026-11"] and upstream.handler.transactions == 2
    assert kept == deferred
    assert rec is not None and rec.state.value == "delivered"
