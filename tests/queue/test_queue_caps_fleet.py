"""Two instances drain one store-and-forward queue on one Redis under an hourly cap: every
unit is counted at delivery by whichever instance claims the entry, so racing instances
send exactly the cap and hold the rest for the hour (DESIGN.md §4a, §5). Counted at the
upstream."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from smtpguard.policy.limits import month_of
from tests.support import RedisServer, Upstream, base_config, message, running_guard, send
from tests.support.eventually import eventually

CAP = 5
MESSAGES = 20


async def test_two_instances_send_exactly_the_hourly_cap_and_hold_the_rest(
    tmp: Path, upstream: Upstream
) -> None:
    redis = RedisServer(tmp, durable=True)
    redis.start()

    def config(name: str) -> dict[str, object]:
        cfg = base_config(
            tmp,
            upstream.port,
            instance=name,
            store={"url": redis.url},
            zones__acme__delivery="queue",
            zones__acme__hourly_cap=CAP,
            zones__acme__monthly_cap=1_000_000,
        )
        cfg["queue"] = {"backoff": {"base": "100ms", "max": "500ms"}, "poll_interval": "20ms", "workers": 8}
        return cfg

    try:
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(running_guard(config("a")))
            b = await stack.enter_async_context(running_guard(config("b")))
            store = a.store
            assert store is not None
            replies = await asyncio.gather(
                *(send((a, b)[i % 2].ports[0], message(f"cap:{i}")) for i in range(MESSAGES))
            )
            assert [r.code for r in replies] == [250] * MESSAGES

            async def states() -> list[tuple[str, float | None]]:
                recs = [await store.get("acme", f"cap:{i}") for i in range(MESSAGES)]
                return [(r.state.value, r.next_attempt_at) if r else ("gone", None) for r in recs]

            # Settled: CAP delivered, every other one held for the hour by the cap.
            now = store.now()
            final = await eventually(
                states,
                lambda got: (
                    sum(s == "delivered" for s, _ in got) == CAP
                    and all(s == "delivered" or (due is not None and due > now + 1800) for s, due in got)
                ),
                timeout=30,
                interval=0.05,
            )
            usage = await store.cap_usage("acme", store.now(), month_of(store.now()))
    finally:
        redis.stop()
    keys = upstream.event_keys()
    print(f"hourly cap {CAP} across two instances: upstream {len(keys)}, usage {usage}, states {final}")
    assert len(keys) == CAP and len(set(keys)) == CAP
    assert usage.hour == CAP
    assert sum(s == "delivered" for s, _ in final) == CAP
