"""One contract, two backends: every promise of smtpguard/store/base.py, checked against a
SQLite file and a real redis-server. Time is passed in (`now`), never slept through."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, Record, State, Submission
from smtpguard.policy.limits import HOUR, CapCheck, CapReached, Caps, cap_check, month_of
from smtpguard.policy.outcome import Kind, Outcome, upstream_reply
from smtpguard.store import (
    CapUsage,
    Conflict,
    Paused,
    Reserved,
    Store,
    StoreUnavailable,
    Suppression,
    store_from_url,
)
from smtpguard.store.redis import RedisStore
from tests.support import RedisServer, free_port

NOW = 1_790_000_000.0  # 2026-09-21 14:13 UTC: hours from any month boundary
MONTH = month_of(NOW)
DAY = 86400.0
RETENTION = 30 * DAY


@pytest.fixture(params=["sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'state.db'}"
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url
        plain = aioredis.Redis.from_url(url)
        await plain.flushall()
        await plain.aclose()
    s = store_from_url(url)
    await s.open()
    await s.open()  # idempotent
    yield s
    await s.close()


def fresh(key: str, zone: str = "acme", now: float = NOW, attempt: str | None = None) -> Record:
    sub = Submission(zone, key, f"fp:{key}", attempt or f"att:{key}", "inst-1", f"<{key}@test>")
    verdict = ledger.decide(None, sub, now, LedgerSettings())
    assert isinstance(verdict, ledger.Proceed)
    return verdict.record


def settled(rec: Record, now: float, state: State = State.DELIVERED) -> Record:
    return replace(rec, state=state, version=rec.version + 1, updated_at=now, owner=None, lease_until=None)


def cap(token: str, now: float = NOW, hourly: int = 10, monthly: int = 1000, zone: str = "acme") -> CapCheck:
    return cap_check(zone, Caps(hourly, monthly), token, now)


# --- ledger ----------------------------------------------------------------------------------
async def test_ping(store: Store) -> None:
    assert await store.ping() is True


async def test_get_absent(store: Store) -> None:
    assert await store.get("acme", "nope") is None


async def test_reserve_new_then_conflict_with_current(store: Store) -> None:
    rec = fresh("k1")
    assert await store.reserve(rec, None, None, False) == Reserved()
    assert await store.get("acme", "k1") == rec
    rival = fresh("k1", attempt="att:rival")
    assert await store.reserve(rival, None, None, False) == Conflict(rec)
    assert await store.get("acme", "k1") == rec


async def test_reserve_expecting_a_version_of_an_absent_key_conflicts(store: Store) -> None:
    assert await store.reserve(fresh("k1"), 3, None, False) == Conflict(None)
    assert await store.get("acme", "k1") is None


async def test_reserve_over_an_expected_version(store: Store) -> None:
    first = fresh("k1")
    await store.reserve(first, None, None, False)
    retry = replace(first, version=2, sg_id="att:second", updated_at=NOW + 60)
    assert await store.reserve(retry, 1, None, False) == Reserved()
    assert await store.reserve(replace(retry, version=3), 1, None, False) == Conflict(retry)


async def test_keys_and_zones_are_separate(store: Store) -> None:
    a = fresh("k1", zone="acme")
    b = fresh("k1", zone="globex")
    assert await store.reserve(a, None, None, False) == Reserved()
    assert await store.reserve(b, None, None, False) == Reserved()
    assert await store.get("acme", "k1") == a
    assert await store.get("globex", "k1") == b


async def test_fifty_concurrent_reserves_of_one_key_one_wins(store: Store) -> None:
    rivals = [fresh("hot", attempt=f"att:{i}") for i in range(50)]
    results = await asyncio.gather(*(store.reserve(r, None, None, False) for r in rivals))
    winners = [r for r, res in zip(rivals, results, strict=True) if isinstance(res, Reserved)]
    assert len(winners) == 1
    assert all(res == Conflict(winners[0]) for res in results if not isinstance(res, Reserved))
    assert await store.get("acme", "hot") == winners[0]


async def test_record_round_trips_with_history(store: Store) -> None:
    rec = fresh("k1")
    await store.reserve(rec, None, None, False)
    outcome = Outcome(
        Kind.DELIVERED, "primary", upstream_reply(250, "2.0.0 Ok: queued as Q1"), upstream_id="Q1"
    )
    done = ledger.settle(rec, rec.sg_id, "inst-1", outcome, NOW + 1, LedgerSettings(), "<k1@test>")
    done = ledger.resolve(replace(done, state=State.UNKNOWN), "delivered", "ops", NOW + 2)
    assert await store.put(done, rec.version) is None
    got = await store.get("acme", "k1")
    assert got == done
    assert got is not None and got.attempts[0].upstream_id == "Q1" and got.audit[0].actor == "ops"


async def test_put_is_compare_and_swap(store: Store) -> None:
    rec = fresh("k1")
    await store.reserve(rec, None, None, False)
    v2 = settled(rec, NOW + 1)
    assert await store.put(v2, 1) is None
    assert await store.get("acme", "k1") == v2
    stale = replace(rec, version=2, phase=ledger.Phase.DATA_SENT)
    assert await store.put(stale, 1) == Conflict(v2)
    assert await store.get("acme", "k1") == v2


async def test_put_over_a_vanished_record_is_a_conflict(store: Store) -> None:
    # Not None: a write over a purged or never-written record must not read as done.
    assert await store.put(fresh("ghost"), 1) == Conflict(None)
    assert await store.get("acme", "ghost") is None


async def test_put_expecting_absence_creates_once(store: Store) -> None:
    rec = fresh("k1")
    assert await store.put(rec, None) is None
    assert await store.get("acme", "k1") == rec
    assert await store.put(fresh("k1", attempt="att:rival"), None) == Conflict(rec)


# --- pause -----------------------------------------------------------------------------------
async def test_pause_switch(store: Store) -> None:
    assert await store.is_paused("acme") is False
    await store.set_paused("acme", True)
    await store.set_paused("acme", True)
    assert await store.is_paused("acme") is True
    assert await store.is_paused("globex") is False
    assert await store.reserve(fresh("k1"), None, cap("t1"), False) == Paused()
    assert await store.get("acme", "k1") is None
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(0, 0)
    assert await store.reserve(fresh("k1", zone="globex"), None, None, False) == Reserved()
    await store.set_paused("acme", False)
    await store.set_paused("acme", False)
    assert await store.is_paused("acme") is False
    assert await store.reserve(fresh("k1"), None, cap("t1"), False) == Reserved()


async def test_paused_argument_forces_pause(store: Store) -> None:
    assert await store.reserve(fresh("k1"), None, cap("t1"), True) == Paused()
    assert await store.get("acme", "k1") is None
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(0, 0)


async def test_duplicate_is_answered_before_pause_and_caps(store: Store) -> None:
    rec = fresh("k1")
    await store.reserve(rec, None, cap("t1", hourly=1, monthly=1), False)
    again = fresh("k1", attempt="att:again")
    # Over both caps and paused twice over: the duplicate still learns the current record.
    await store.set_paused("acme", True)
    assert await store.reserve(again, None, cap("t2", hourly=1, monthly=1), True) == Conflict(rec)
    await store.set_paused("acme", False)
    assert await store.reserve(again, None, cap("t2", hourly=1, monthly=1), False) == Conflict(rec)
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(1, 1)


# --- caps ------------------------------------------------------------------------------------
async def test_hourly_cap_is_exact_under_concurrency(store: Store) -> None:
    recs = [fresh(f"k{i}", now=NOW + i) for i in range(30)]
    results = await asyncio.gather(
        *(store.reserve(r, None, cap(f"t{i}", NOW + i, hourly=10), False) for i, r in enumerate(recs))
    )
    won = [i for i, res in enumerate(results) if isinstance(res, Reserved)]
    assert len(won) == 10
    free_at = NOW + min(won) + HOUR
    refused = [res for res in results if not isinstance(res, Reserved)]
    assert refused == [CapReached("hour", 10, free_at)] * 20
    for i in range(30):
        assert (await store.get("acme", f"k{i}") is not None) == (i in won)
    assert await store.cap_usage("acme", NOW + 30, MONTH) == CapUsage(10, 10)


async def test_monthly_cap_is_exact_under_concurrency(store: Store) -> None:
    results = await asyncio.gather(
        *(store.reserve(fresh(f"k{i}"), None, cap(f"t{i}", hourly=100, monthly=7), False) for i in range(30))
    )
    assert results.count(Reserved()) == 7
    assert results.count(CapReached("month", 7)) == 23
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(7, 7)


async def test_monthly_cap_is_checked_before_hourly(store: Store) -> None:
    assert await store.reserve(fresh("k1"), None, cap("t1", hourly=1, monthly=1), False) == Reserved()
    # Both caps are reached; the month is the one the client is told about.
    assert await store.reserve(fresh("k2"), None, cap("t2", hourly=1, monthly=1), False) == CapReached(
        "month", 1
    )


async def test_monthly_cap_spans_hours(store: Store) -> None:
    for i in range(3):
        t = NOW + i * 2 * HOUR
        assert await store.reserve(fresh(f"k{i}", now=t), None, cap(f"t{i}", t, 100, 3), False) == Reserved()
    late = NOW + 7 * HOUR
    assert await store.reserve(fresh("k3", now=late), None, cap("t3", late, 100, 3), False) == CapReached(
        "month", 3
    )
    assert await store.cap_usage("acme", late, MONTH) == CapUsage(0, 3)


async def test_zero_cap_refuses_everything(store: Store) -> None:
    assert await store.reserve(fresh("k1"), None, cap("t1", hourly=0, monthly=0), False) == CapReached(
        "month", 0
    )
    assert await store.reserve(fresh("k1"), None, cap("t1", hourly=0, monthly=5), False) == CapReached(
        "hour", 0, NOW + HOUR
    )


async def test_hourly_window_slides(store: Store) -> None:
    async def at(key: str, t: float) -> object:
        return await store.reserve(fresh(key, now=t), None, cap(f"tok:{key}", t, hourly=2), False)

    assert await at("a", NOW) == Reserved()
    assert await at("b", NOW + 10) == Reserved()
    assert await at("c", NOW + 20) == CapReached("hour", 2, NOW + HOUR)
    # The send at NOW is still inside the window that starts exactly at NOW.
    assert await at("c", NOW + HOUR) == CapReached("hour", 2, NOW + HOUR)
    assert await at("c", NOW + HOUR + 0.5) == Reserved()
    assert await at("d", NOW + HOUR + 1) == CapReached("hour", 2, NOW + 10 + HOUR)
    assert await store.cap_usage("acme", NOW + HOUR + 1, MONTH) == CapUsage(2, 3)


async def test_caps_are_per_zone(store: Store) -> None:
    assert await store.reserve(fresh("k1"), None, cap("t1", hourly=1), False) == Reserved()
    assert await store.reserve(
        fresh("k1", zone="globex"), None, cap("t1", hourly=1, zone="globex"), False
    ) == (Reserved())
    assert await store.cap_usage("globex", NOW, MONTH) == CapUsage(1, 1)


async def test_refund_returns_one_unit_once(store: Store) -> None:
    assert await store.reserve(fresh("k1"), None, cap("t1", hourly=1), False) == Reserved()
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(1, 1)
    await store.refund("acme", "t1", MONTH)
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(0, 0)
    await store.refund("acme", "t1", MONTH)
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(0, 0)
    assert await store.reserve(fresh("k2"), None, cap("t2", hourly=1), False) == Reserved()
    # A second refund of t1 must not take t2's unit.
    await store.refund("acme", "t1", MONTH)
    await store.refund("acme", "never-reserved", MONTH)
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(1, 1)
    assert await store.reserve(fresh("k3"), None, cap("t3", hourly=1), False) == CapReached(
        "hour", 1, NOW + HOUR
    )


async def test_cap_usage_counts_the_last_hour_and_the_month(store: Store) -> None:
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(0, 0)
    for i in range(3):
        await store.reserve(fresh(f"k{i}", now=NOW + i), None, cap(f"t{i}", NOW + i), False)
    assert await store.cap_usage("acme", NOW + 2, MONTH) == CapUsage(3, 3)
    assert await store.cap_usage("acme", NOW + HOUR + 0.5, MONTH) == CapUsage(2, 3)
    assert await store.cap_usage("acme", NOW + 2 * HOUR, MONTH) == CapUsage(0, 3)
    assert await store.cap_usage("acme", NOW, "1999-01") == CapUsage(3, 0)


# --- statistics ------------------------------------------------------------------------------
async def test_counts_add_up_per_zone(store: Store) -> None:
    assert await store.counts("acme") == {}
    await store.add_counts("acme", {"sent": 1, "duplicate": 2})
    await store.add_counts("acme", {"sent": 3, "rejected:cap_hour": 1})
    await store.add_counts("acme", {})
    await store.add_counts("globex", {"sent": 7})
    assert await store.counts("acme") == {"sent": 4, "duplicate": 2, "rejected:cap_hour": 1}
    assert await store.counts("globex") == {"sent": 7}


# --- suppression -----------------------------------------------------------------------------
async def test_suppression_add_list_remove(store: Store) -> None:
    assert await store.suppress_add("acme", "User@EXAMPLE.com", "bounced", NOW) is True
    assert await store.suppress_add("acme", "<User@example.COM>", "again", NOW + 1) is False
    assert await store.suppress_add("acme", "a@example.com", "manual", NOW + 2) is True
    assert await store.suppress_list("acme") == [
        Suppression("acme", "User@example.com", "bounced", NOW),
        Suppression("acme", "a@example.com", "manual", NOW + 2),
    ]
    assert await store.suppress_list("globex") == []
    assert await store.suppressed("acme", "User@example.com") == "acme"
    assert await store.suppressed("acme", "User@Example.Com") == "acme"
    # Local parts may be case-sensitive (RFC 5321 §2.4): only the domain is normalised.
    assert await store.suppressed("acme", "user@example.com") is None
    assert await store.suppressed("globex", "User@example.com") is None
    assert await store.suppress_remove("acme", "User@EXAMPLE.COM") is True
    assert await store.suppress_remove("acme", "User@example.com") is False
    assert await store.suppressed("acme", "User@example.com") is None


async def test_global_suppression_applies_to_every_zone(store: Store) -> None:
    assert await store.suppress_add("global", "x@Spam.example", "complaint", NOW) is True
    assert await store.suppressed("acme", "x@spam.EXAMPLE") == "global"
    assert await store.suppressed("globex", "x@spam.example") == "global"
    assert await store.suppressed("global", "x@spam.example") == "global"
    # On both lists, the zone's own list is named.
    await store.suppress_add("acme", "x@spam.example", "bounced", NOW)
    assert await store.suppressed("acme", "x@spam.example") == "acme"
    assert await store.suppress_list("global") == [Suppression("global", "x@spam.example", "complaint", NOW)]


# --- AUTH failures ---------------------------------------------------------------------------
async def test_auth_failures_count_within_the_window(store: Store) -> None:
    window = 300.0
    assert [await store.auth_failure("192.0.2.1", NOW + i, window) for i in range(3)] == [1, 2, 3]
    assert await store.auth_failures("192.0.2.1", NOW + 2, window) == 3
    assert await store.auth_failures("192.0.2.9", NOW + 2, window) == 0
    # A failure exactly `window` old has left it.
    assert await store.auth_failures("192.0.2.1", NOW + window + 1, window) == 1
    assert await store.auth_failure("192.0.2.1", NOW + 1000, window) == 1
    assert await store.auth_failure("192.0.2.2", NOW + 1000, window) == 1


async def test_concurrent_auth_failures_are_all_counted(store: Store) -> None:
    counts = await asyncio.gather(*(store.auth_failure("198.51.100.7", NOW, 300) for _ in range(20)))
    assert sorted(counts) == list(range(1, 21))


# --- purge -----------------------------------------------------------------------------------
async def test_purge_deletes_only_settled_old_records(store: Store) -> None:
    old_delivered = fresh("old-delivered")
    old_failed = fresh("old-failed", zone="globex")
    old_in_flight = fresh("old-in-flight")
    old_queued = replace(fresh("old-queued"), state=State.QUEUED)
    recent = fresh("recent")
    for r in (old_delivered, old_failed, old_in_flight, old_queued, recent):
        assert await store.reserve(r, None, None, False) == Reserved()
    await store.put(settled(old_delivered, NOW), 1)
    await store.put(settled(old_failed, NOW, State.FAILED), 1)
    # Created as old as the others, but updated since: kept.
    await store.put(settled(recent, NOW + RETENTION), 1)

    assert await store.purge(NOW + RETENTION + 1, RETENTION) == 2
    assert await store.get("acme", "old-delivered") is None
    assert await store.get("globex", "old-failed") is None
    assert await store.get("acme", "old-in-flight") == old_in_flight
    assert await store.get("acme", "old-queued") == old_queued
    assert await store.get("acme", "recent") is not None
    assert await store.purge(NOW + RETENTION + 1, RETENTION) == 0
    # A key purged is a new key again.
    assert await store.reserve(fresh("old-delivered"), None, None, False) == Reserved()


async def test_purge_works_through_many_records(store: Store) -> None:
    recs = [fresh(f"k{i:04}", now=NOW + i) for i in range(1500)]
    # Every other record stays in flight: more old unsettled records than a Redis purge batch
    # (500), interleaved with settled ones, so a purge must step over them, not stall on them.
    for chunk in range(0, len(recs), 100):
        part = recs[chunk : chunk + 100]
        await asyncio.gather(*(store.reserve(r, None, None, False) for r in part))
        await asyncio.gather(*(store.put(settled(r, r.updated_at), 1) for r in part[1::2]))
    later = NOW + 1500 + RETENTION
    assert await asyncio.wait_for(store.purge(later, RETENTION), 30) == 750
    assert await store.get("acme", "k0000") is not None
    assert await store.get("acme", "k0001") is None
    assert await asyncio.wait_for(store.purge(later, RETENTION), 30) == 0


async def test_purge_trims_stale_window_entries(store: Store) -> None:
    await store.reserve(fresh("k1"), None, cap("t1"), False)
    await store.auth_failure("192.0.2.1", NOW, 300)
    assert await store.cap_usage("acme", NOW + 1, MONTH) == CapUsage(1, 1)
    await store.purge(NOW + 3 * HOUR, RETENTION)
    # The send left the window table; the month still counts it.
    assert await store.cap_usage("acme", NOW + 1, MONTH) == CapUsage(0, 1)
    assert await store.get("acme", "k1") is not None
    # Refunding a unit whose window entry was purged returns nothing: it was spent.
    await store.refund("acme", "t1", MONTH)
    assert await store.cap_usage("acme", NOW + 1, MONTH) == CapUsage(0, 1)


# --- cancellation ----------------------------------------------------------------------------
async def test_a_cancelled_caller_stops(store: Store) -> None:
    """The relay cancels its lease renewer when the upstream answers, then awaits it: a
    cancellation lost inside a store call would keep renewing the lease and hang the session
    (redis-py's asyncio.wait_for path on Python 3.11 loses it)."""
    rec = fresh("k1")
    await store.reserve(rec, None, None, False)
    calls = 0
    busy = asyncio.Event()

    async def renewer() -> None:
        nonlocal calls
        while True:
            await store.get("acme", "k1")
            calls += 1
            if calls == 200:
                busy.set()

    task = asyncio.create_task(renewer())
    await asyncio.wait_for(busy.wait(), 10)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=3)
    assert task in done and task.cancelled()


# --- failure is loud -------------------------------------------------------------------------
async def test_closed_store_is_unavailable(store: Store) -> None:
    await store.close()
    assert await store.ping() is False
    with pytest.raises(StoreUnavailable):
        await store.get("acme", "k1")
    with pytest.raises(StoreUnavailable):
        await store.reserve(fresh("k1"), None, None, False)


# --- Redis only ------------------------------------------------------------------------------
async def test_redis_unreachable_is_store_unavailable_and_quick() -> None:
    s = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
    await s.open()
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await s.reserve(fresh("k1"), None, cap("t1"), False)
        with pytest.raises(StoreUnavailable):
            await s.get("acme", "k1")
        with pytest.raises(StoreUnavailable):
            await s.put(fresh("k1"), 1)
        with pytest.raises(StoreUnavailable):
            await s.suppressed("acme", "a@example.com")
        assert await s.ping() is False
        assert time.monotonic() - started < 5
    finally:
        await s.close()


async def test_redis_store_recovers_when_redis_returns(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, durable=True)
    server.start()
    s = RedisStore(server.url)
    await s.open()
    try:
        rec = fresh("k1")
        assert await s.reserve(rec, None, cap("t1"), False) == Reserved()
        # A crash, not a shutdown: with appendfsync always the acknowledged reservation stays.
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await s.get("acme", "k1")
        with pytest.raises(StoreUnavailable):
            await s.reserve(fresh("k2"), None, cap("t2"), False)
        assert await s.ping() is False
        assert time.monotonic() - started < 5

        server = RedisServer(tmp_path, port=server.port, durable=True)
        server.start()
        # The same object, no reopen: the pool reconnects and the script cache is reloaded.
        assert await s.get("acme", "k1") == rec
        assert await s.reserve(fresh("k1", attempt="att:x"), None, cap("t3"), False) == Conflict(rec)
        assert await s.reserve(fresh("k2"), None, cap("t2"), False) == Reserved()
        assert await s.cap_usage("acme", NOW, MONTH) == CapUsage(2, 2)
        assert await s.ping() is True
    finally:
        await s.close()
        server.stop()


async def test_redis_password_argument_overrides_the_url(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        admin = aioredis.Redis.from_url(server.url)
        await admin.config_set("requirepass", "right-pass")
        await admin.aclose()
        url = f"redis://:wrong-pass@127.0.0.1:{server.port}/0"
        wrong = RedisStore(url)
        await wrong.open()
        with pytest.raises(StoreUnavailable):
            await wrong.get("acme", "k1")
        await wrong.close()
        right = store_from_url(url, password="right-pass")
        await right.open()
        assert await right.reserve(fresh("k1"), None, None, False) == Reserved()
        await right.close()
    finally:
        server.stop()


async def test_redis_keys_of_a_zone_share_its_cluster_slot(redis_server: RedisServer) -> None:
    plain = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await plain.flushall()
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        for zone in ("acme", "globex"):
            rec = fresh("k1", zone=zone)
            await s.reserve(rec, None, cap("t1", zone=zone), False)
            await s.put(settled(rec, NOW), 1)
            await s.set_paused(zone, True)
            await s.add_counts(zone, {"sent": 1})
            await s.suppress_add(zone, "a@example.com", "x", NOW)
        await s.suppress_add("global", "b@example.com", "x", NOW)
        await s.auth_failure("192.0.2.1", NOW, 300)
        keys = [str(k) for k in await plain.keys("*")]
        by_zone = {z: [k for k in keys if f"{{{z}}}" in k] for z in ("acme", "globex", "global")}
        # record, index, sends, month, paused, counts, suppression
        assert len(by_zone["acme"]) == len(by_zone["globex"]) == 7
        for zone, zone_keys in by_zone.items():
            assert {key_slot(k.encode()) for k in zone_keys} == {key_slot(zone.encode())}
        assert {k for k in keys if not any(k in v for v in by_zone.values())} == {
            "sg:zones",
            "sg:{auth:192.0.2.1}:fail",
        }
    finally:
        await s.close()
        await plain.aclose()
