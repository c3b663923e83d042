"""Two `smtpguard serve` processes sharing one real redis-server (issue 3, DESIGN.md §7): the
ledger, the caps and the kill switch hold across instances, and losing Redis sends nothing.
Counted at a real recording upstream; every test starts and stops its own durable Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from smtpguard.cli import main
from smtpguard.store.redis import RedisStore
from tests.support import (
    Behaviour,
    GuardProcess,
    RedisServer,
    Reply,
    Upstream,
    base_config,
    free_port,
    message,
    send,
    write_config,
)
from tests.support.eventually import eventually

pytestmark = pytest.mark.slow


@dataclass
class Pair:
    redis: RedisServer
    ports: list[int]
    configs: list[Path]
    guards: list[GuardProcess]

    def port(self, i: int) -> int:
        """Submissions alternate between instance a and instance b."""
        return self.ports[i % 2]


@contextlib.asynccontextmanager
async def two_instances(tmp: Path, upstream: Upstream, **overrides: Any) -> AsyncIterator[Pair]:
    redis_dir = tmp / "redis"
    redis_dir.mkdir()
    redis = RedisServer(redis_dir, durable=True)
    redis.start()
    pair = Pair(redis, [], [], [])
    try:
        for name in ("a", "b"):
            port = free_port()
            cfg = base_config(tmp, upstream.port, instance=name, store__url=redis.url, **overrides)
            cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
            path = write_config(tmp / f"{name}.yaml", cfg)
            guard = GuardProcess(path, tmp / f"{name}.log")
            guard.start()
            pair.guards.append(guard)
            pair.ports.append(port)
            pair.configs.append(path)
        for guard, port in zip(pair.guards, pair.ports, strict=True):
            await guard.wait_port(port)
        yield pair
    except BaseException:
        for guard in pair.guards:
            print(f"--- {guard.log_path.name} ---\n{guard.log_path.read_text()[-3000:]}")
        raise
    finally:
        # In threads: the recording upstream runs on this event loop, and a graceful stop
        # says QUIT to it over the pooled connections.
        codes = await asyncio.gather(*(asyncio.to_thread(guard.stop) for guard in pair.guards))
        pair.redis.stop()
    assert codes == [0, 0], f"unclean stop: {codes}"


def cli(path: Path, *args: str) -> int:
    return main([*args, "-c", str(path)])


def decisions(log: Path, key: str) -> list[tuple[str, float]]:
    """(decision, latency in ms) of every submission of `key` an instance logged."""
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("msg") == "decision" and entry.get("event_key") == key:
                out.append((str(entry["decision"]), float(entry["latency_ms"])))
    return out


def worker_decisions(log: Path) -> list[tuple[str, str]]:
    """(event key, decision) of every delivery the instance's queue worker logged."""
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("msg") == "decision" and entry.get("user") == "delivery":
                out.append((str(entry["event_key"]), str(entry["decision"])))
    return out


def is_451(reply: Reply, enhanced: str) -> bool:
    return reply.code == 451 and reply.text.startswith(enhanced)


async def test_one_key_submitted_fifty_times_to_two_instances_is_sent_once(
    tmp: Path, upstream: Upstream
) -> None:
    # The upstream takes its time after the dot, so the rivals arrive while it is in flight.
    upstream.handler.default = Behaviour(hang_after_dot=0.3)
    async with two_instances(tmp, upstream) as pair:
        replies = await asyncio.gather(*(send(pair.port(i), message("multi:one")) for i in range(50)))
    n = len(replies)
    by_instance = {g.log_path.stem: decisions(g.log_path, "multi:one") for g in pair.guards}
    # The upstream holds its reply 0.3 s: most duplicates were answered while (or just after)
    # the winner's record was in flight, i.e. the submissions really overlapped.
    slow = sum(d == "duplicate" and ms >= 100 for log in by_instance.values() for d, ms in log)
    per_instance = {name: dict(Counter(d for d, _ in log)) for name, log in by_instance.items()}
    print(
        f"multi-instance: {n} concurrent submissions of one key → {len(upstream.received)} upstream; "
        f"decisions {per_instance}; {slow} duplicates answered >= 100 ms after their dot"
    )
    assert all(Counter(d for d, _ in log)["duplicate"] >= 1 for log in by_instance.values())
    assert sum(len(log) for log in by_instance.values()) == n
    assert len(upstream.received) == 1
    assert upstream.event_keys() == ["multi:one"]
    assert [r.code for r in replies] == [250] * n, [str(r) for r in replies if r.code != 250]
    assert sum("duplicate" in r.text for r in replies) == n - 1


async def test_hourly_cap_is_exact_across_two_instances(tmp: Path, upstream: Upstream) -> None:
    async with two_instances(tmp, upstream, zones__acme__hourly_cap=10) as pair:
        replies = await asyncio.gather(*(send(pair.port(i), message(f"multi:cap:{i}")) for i in range(30)))
    sent = sum(r.code == 250 for r in replies)
    capped = sum(is_451(r, "4.7.0") for r in replies)
    print(
        f"multi-instance: 30 keys, hourly_cap 10 → {sent} x 250, {capped} x 451 4.7.0, "
        f"{len(upstream.received)} upstream"
    )
    assert len(upstream.received) == 10
    assert sent == 10 and capped == 20
    assert all("duplicate" not in r.text for r in replies)
    # Each accepted key was sent once, and only accepted keys were sent.
    accepted = {f"multi:cap:{i}" for i, r in enumerate(replies) if r.code == 250}
    assert Counter(upstream.event_keys()) == Counter(accepted)


async def test_pause_through_the_cli_stops_both_instances(tmp: Path, upstream: Upstream) -> None:
    async with two_instances(tmp, upstream) as pair:
        before = await asyncio.gather(
            send(pair.port(0), message("multi:p0")), send(pair.port(1), message("multi:p1"))
        )
        assert [r.code for r in before] == [250, 250]

        assert await asyncio.to_thread(cli, pair.configs[0], "pause", "acme") == 0
        # Asked at once, no wait: both instances already answer the pause.
        held = await asyncio.gather(
            send(pair.port(0), message("multi:p2")), send(pair.port(1), message("multi:p3"))
        )
        # A delivered event still answers 250 duplicate while paused (DESIGN.md §3 order).
        dup = await send(pair.port(1), message("multi:p0"))
        during = len(upstream.received)

        assert await asyncio.to_thread(cli, pair.configs[1], "resume", "acme") == 0
        after = await asyncio.gather(
            send(pair.port(0), message("multi:p2")), send(pair.port(1), message("multi:p3"))
        )
    print(
        f"multi-instance: paused via CLI → both answered {[f'{r.code} {r.text[:5]}' for r in held]} "
        f"at once; resumed → {[r.code for r in after]}; upstream {len(upstream.received)}"
    )
    assert all(is_451(r, "4.7.0") and "paused" in r.text for r in held), [str(r) for r in held]
    assert dup.code == 250 and "duplicate" in dup.text
    assert during == 2
    assert [r.code for r in after] == [250, 250] and all("duplicate" not in r.text for r in after)
    assert sorted(k or "" for k in upstream.event_keys()) == ["multi:p0", "multi:p1", "multi:p2", "multi:p3"]


async def test_losing_redis_sends_nothing_and_both_instances_recover_without_restart(
    tmp: Path, upstream: Upstream
) -> None:
    async with two_instances(tmp, upstream) as pair:
        first = await asyncio.gather(
            send(pair.port(0), message("multi:r0")), send(pair.port(1), message("multi:r1"))
        )
        assert [r.code for r in first] == [250, 250]

        # A crash, not a shutdown: appendfsync always keeps every acknowledged write.
        assert pair.redis.proc is not None
        pair.redis.proc.kill()
        pair.redis.proc.wait()
        down = await asyncio.gather(*(send(pair.port(i), message(f"multi:down:{i}")) for i in range(6)))
        # Even the duplicate of a delivered event cannot be answered: nothing is sent blind.
        down_dup = await send(pair.port(1), message("multi:r0"))
        during = len(upstream.received)

        pair.redis = RedisServer(pair.redis.tmp, port=pair.redis.port, durable=True)
        pair.redis.start()
        # The same processes: no restart, no reload. Their pools reconnect on the next use.
        again = await asyncio.gather(*(send(pair.port(i), message(f"multi:down:{i}")) for i in range(6)))
        dups = await asyncio.gather(
            send(pair.port(1), message("multi:r0")), send(pair.port(0), message("multi:r1"))
        )
    print(
        f"multi-instance: redis killed → {sum(is_451(r, '4.3.0') for r in down)}/{len(down)} x 451 4.3.0, "
        f"{during - 2} new upstream; restarted → {sum(r.code == 250 for r in again)}/{len(again)} x 250, "
        f"upstream {len(upstream.received)}"
    )
    assert all(is_451(r, "4.3.0") for r in [*down, down_dup]), [str(r) for r in [*down, down_dup]]
    assert during == 2
    assert [r.code for r in again] == [250] * 6 and all("duplicate" not in r.text for r in again), [
        str(r) for r in again
    ]
    # The ledger survived the crash: what was delivered before is still a duplicate.
    assert all(r.code == 250 and "duplicate" in r.text for r in dups)
    assert Counter(upstream.event_keys()) == Counter(
        ["multi:r0", "multi:r1", *(f"multi:down:{i}" for i in range(6))]
    )


async def test_store_and_forward_across_two_instances_delivers_each_event_once(
    tmp: Path, upstream: Upstream
) -> None:
    """Both instances accept into one Redis queue and both workers claim from it (§4a): every
    event reaches the upstream once, whichever instance accepted or delivered it."""
    upstream.handler.default = Behaviour(hang_after_dot=0.05)
    overrides: dict[str, Any] = {
        "zones__acme__delivery": "queue",
        "zones__acme__hourly_cap": 100_000,
        "zones__acme__monthly_cap": 1_000_000,
        "event_key__lease": "2s",
        "queue": {"backoff": {"base": "200ms", "max": "1s"}, "workers": 4, "poll_interval": "100ms"},
    }
    n = 40
    async with two_instances(tmp, upstream, **overrides) as pair:
        started = time.monotonic()
        accepted = await asyncio.gather(*(send(pair.port(i), message(f"multi:q:{i}")) for i in range(n)))
        t_accepted = time.monotonic() - started
        # Each event again, to the other instance: answered from the ledger, never queued twice.
        dups = await asyncio.gather(*(send(pair.port(i + 1), message(f"multi:q:{i}")) for i in range(n)))
        await upstream.wait_received(n, timeout=30)
        t_delivered = time.monotonic() - started
        store = RedisStore(pair.redis.url)
        await store.open()
        try:
            # Drained: every entry settled and off the queue (claims of 2 s have all expired).
            if await eventually(lambda: store.queue_entries(None), lambda e: not e, timeout=30, interval=0.1):
                raise AssertionError(f"queue not drained: {await store.queue_entries(None)}")
            t_drained = time.monotonic() - started
            states = Counter(
                rec.state.value if rec else "missing"
                for rec in [await store.get("acme", f"multi:q:{i}") for i in range(n)]
            )
        finally:
            await store.close()
    delivered_by = {
        g.log_path.stem: sum(d == "relayed" for _, d in worker_decisions(g.log_path)) for g in pair.guards
    }
    print(
        f"multi-instance queue: {n} accepted on two instances → {len(upstream.received)} upstream, "
        f"{len(set(upstream.event_keys()))} distinct; delivered by {delivered_by}; states {dict(states)}; "
        f"accepted {t_accepted:.1f}s, delivered {t_delivered:.1f}s, drained {t_drained:.1f}s"
    )
    assert all(r.code == 250 and "queued" in r.text for r in accepted), [str(r) for r in accepted]
    assert all(r.code == 250 and "duplicate" in r.text for r in dups), [str(r) for r in dups]
    assert Counter(upstream.event_keys()) == Counter(f"multi:q:{i}" for i in range(n))
    assert states == Counter({"delivered": n})
    assert sum(delivered_by.values()) == n
