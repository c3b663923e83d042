"""Lost 250s settled by the provider's log (DESIGN.md §19), in one run.

    .venv/bin/python -m bench.verdicts                 # 1,000 events, 5% of replies lost
    .venv/bin/python -m bench.verdicts --events 200 --lost 0.1 --store redis://127.0.0.1:6379/0

One smtpguard (in this process, its clock injected) relays N events from 20 concurrent real
SMTP clients to the test suite's recording upstream, which takes the final dot of a seeded
5% of the transactions and drops the connection before its reply: those events are
`unknown`. A local fake of Mailgun's Events API (real HTTP) logs every message the upstream
took, each visible only after a random delay (0 to --max-delay, on the injected clock:
provider logs are eventually consistent). Then the injected clock moves on in steps of
--step, and the verdict loop runs a round after each, until every lost outcome is settled
or --horizon has passed. Then every client retries its event once.

Reported: lost outcomes, how many a verdict settled (and which), how many the upstream
received per event (must be 1: none sent twice, none lost), the retries' replies, requests
made to the log API, and the settle time of each lost outcome — from the attempt to its
verdict — as p50/p99 **on the injected clock** (what production would see with the same
log delays, `after` and `every`; the loop's own cost is the wall time beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import machine_info, write_result
from smtpguard.policy.ledger import State
from tests.support import Behaviour, FakeClock, Upstream, message, running_guard, send
from tests.support.provider_api_fakes import FakeMailgun
from tests.support.verdicts import API_ENV, API_KEY, MAILGUN_DOMAIN, message_id_of, tag_of, verdict_config

SESSIONS = 20


@dataclass
class Report:
    events: int
    lost: int
    settled: dict[str, int] = field(default_factory=dict)
    """Lost outcomes by the state a verdict left them in (delivered, deferred, failed)."""
    unknown: int = 0
    """Records the lost replies left `unknown` (each a 451 to its client)."""
    unsettled: int = 0
    max_copies: int = 0
    """The most copies the upstream received of any one event."""
    missing: int = 0
    """Events the upstream never received."""
    retry_replies: dict[str, int] = field(default_factory=dict)
    api_requests: int = 0
    rounds: int = 0
    settle_p50: float | None = None
    settle_p99: float | None = None
    settle_max: float | None = None
    """Seconds on the injected clock from the lost attempt to its verdict."""
    wall_seconds: float = 0.0
    loop_cpu_seconds: float = 0.0
    """CPU (user+system) of this process over the verdict rounds alone: the loop, its store
    calls and, in the same process, the fake log API answering it (an upper bound)."""
    loop_wall_seconds: float = 0.0
    """Wall time of the verdict rounds alone."""
    loop_cpu_ms_per_settled: float | None = None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


async def run(
    events: int,
    lost_share: float,
    store_url: str | None,
    *,
    seed: int = 19,
    max_delay: float = 1200.0,
    step: float = 30.0,
    horizon: float = 6 * 3600.0,
    tmp: Path | None = None,
    breaker_threshold: int | None = None,
) -> Report:
    """The scenario; `store_url` None: a SQLite file in `tmp` (or a temporary directory).
    `breaker_threshold`: the breaker's failure_threshold, for a lost share high enough to
    open it (every lost reply is a provider failure; the injected clock never cools it)."""
    started = time.monotonic()
    rng = random.Random(seed)
    work = Path(tmp or tempfile.mkdtemp(prefix="bench-verdicts-"))
    url = store_url or f"sqlite:///{work / 'state.db'}"
    lost_n = round(events * lost_share)
    script = [Behaviour(drop_after_dot=True)] * lost_n + [Behaviour()] * (events - lost_n)
    rng.shuffle(script)

    clock = FakeClock()
    upstream = Upstream()
    fake = FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock)
    await upstream.start()
    await fake.start()
    report = Report(events, lost_n)
    try:
        upstream.handler.script = list(script)
        cfg = verdict_config(work, upstream.port, url, "mailgun", fake.base_url)
        cfg["log"] = {"format": "json", "level": "warning"}
        if breaker_threshold is not None:
            cfg["breaker"] = {"failure_threshold": breaker_threshold}
        # the caps are not what is measured (a retry of every event counts too)
        cfg["zones"]["acme"] |= {"plan": "unlimited", "hourly_cap": 3 * events, "monthly_cap": 3 * events}
        os.environ[API_ENV] = API_KEY  # the api's key_env, as serve reads it
        async with running_guard(cfg, clock=clock) as guard:
            assert guard.store is not None and guard.verdicts is not None
            keys = [f"ev:{i}" for i in range(events)]
            replies = await _send_all(guard.ports[0], keys)
            unknown = [k for k, code in replies.items() if code == 451]
            assert all(code in (250, 451) for code in replies.values()), replies
            report.unknown = len(unknown)
            # The provider logged every message it took, each after its own delay.
            for received in upstream.received:
                rec = await guard.store.get("acme", received.header("X-Event-Key") or "")
                assert rec is not None
                fake.add(
                    "accepted",
                    rec.attempts[-1].at,
                    message_id=message_id_of(received),
                    tag=tag_of(received, "mailgun"),
                    delay=rng.uniform(0, max_delay),
                )
            attempt_at = {k: (await _get(guard, k)).attempts[-1].at for k in unknown}
            settled_at: dict[str, float] = {}
            end = clock.t + horizon
            while len(settled_at) < len(unknown) and clock.t < end:
                clock.t += step
                cpu0, wall0 = time.process_time(), time.perf_counter()
                await guard.verdicts.round()
                report.loop_cpu_seconds += time.process_time() - cpu0
                report.loop_wall_seconds += time.perf_counter() - wall0
                report.rounds += 1
                for k in unknown:
                    if k not in settled_at and (await _get(guard, k)).state is not State.UNKNOWN:
                        settled_at[k] = clock.t
            for k in unknown:
                state = (await _get(guard, k)).state.value
                if k in settled_at:
                    report.settled[state] = report.settled.get(state, 0) + 1
            report.unsettled = len(unknown) - len(settled_at)
            report.loop_cpu_seconds = round(report.loop_cpu_seconds, 3)
            report.loop_wall_seconds = round(report.loop_wall_seconds, 3)
            if settled_at:
                report.loop_cpu_ms_per_settled = round(1000 * report.loop_cpu_seconds / len(settled_at), 3)
            times = sorted(settled_at[k] - attempt_at[k] for k in settled_at)
            report.settle_p50 = percentile(times, 0.50)
            report.settle_p99 = percentile(times, 0.99)
            report.settle_max = times[-1] if times else None
            clock.t += 120  # past min_retry_interval for any not-accepted one
            again = await _send_all(guard.ports[0], keys)
            for code in again.values():
                report.retry_replies[str(code)] = report.retry_replies.get(str(code), 0) + 1
            report.api_requests = len(fake.requests)
        copies: dict[str, int] = {}
        for key in upstream.event_keys():
            if key is not None:
                copies[key] = copies.get(key, 0) + 1
        report.max_copies = max(copies.values(), default=0)
        report.missing = events - len(copies)
    finally:
        await fake.stop()
        await upstream.stop()
    report.wall_seconds = round(time.monotonic() - started, 2)
    return report


async def _get(guard: Any, key: str) -> Any:
    rec = await guard.store.get("acme", key)
    assert rec is not None, key
    return rec


async def _send_all(port: int, keys: list[str]) -> dict[str, Any]:
    """Each key once, SESSIONS at a time: key → its reply code, or "250 duplicate"."""
    out: dict[str, Any] = {}
    pending = list(keys)

    async def client() -> None:
        while pending:
            key = pending.pop()
            reply = await send(port, message(key))
            duplicate = reply.code == 250 and "duplicate" in reply.text
            out[key] = f"{reply.code} duplicate" if duplicate else reply.code

    await asyncio.gather(*(client() for _ in range(SESSIONS)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=1000)
    p.add_argument("--lost", type=float, default=0.05, help="share of final-dot replies lost (default 0.05)")
    p.add_argument(
        "--store", default=None, help="store URL (default: a SQLite file in a temporary directory)"
    )
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--max-delay", type=float, default=1200.0, help="log visibility delay, seconds (0..this)")
    p.add_argument("--step", type=float, default=30.0, help="injected clock step between rounds, seconds")
    args = p.parse_args()
    report = asyncio.run(
        run(args.events, args.lost, args.store, seed=args.seed, max_delay=args.max_delay, step=args.step)
    )
    doc = {"machine": machine_info(), "args": vars(args), "report": asdict(report)}
    print(json.dumps(asdict(report), indent=2))
    print(f"written to {write_result('verdicts', doc)}")


if __name__ == "__main__":
    main()
