"""One contract, three backends: every promise of smtpguard/store/base.py, checked against a
SQLite file, a real redis-server and a real PostgreSQL. Time is passed in (`now`), never slept through."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from smtpguard.events.apply import Applied, Applier
from smtpguard.policy import ledger
from smtpguard.policy.events import Kind as EventKind
from smtpguard.policy.events import Match, ProviderEvent
from smtpguard.policy.ledger import LedgerSettings, Record, State, Submission
from smtpguard.policy.limits import HOUR, CapCheck, CapReached, Caps, cap_check, month_of
from smtpguard.policy.outcome import Kind, Outcome, upstream_reply
from smtpguard.store import (
    HELD,
    CapUsage,
    Claimed,
    Conflict,
    Paused,
    QueuedMessage,
    QueueEntry,
    Reserved,
    Store,
    StoreUnavailable,
    Suppression,
    store_from_url,
)
from smtpguard.store.base import StoredEvent, ZoneAudit
from smtpguard.store.redis import RedisStore
from smtpguard.store.sqlite import SQLiteStore
from tests.support import RedisServer, free_port
from tests.support.stores import empty_store_url

# One key each, one slot: set by a background step at open once older data is upgraded.
UPGRADE_MARKERS = {"sg:supp-folded", "sg:lanes-listed", "sg:states-listed"}
NOW = 1_790_000_000.0  # 2026-09-21 14:13 UTC: hours from any month boundary
MONTH = month_of(NOW)
DAY = 86400.0
RETENTION = 30 * DAY


@pytest.fixture(params=["sqlite", "redis", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    s = store_from_url(await empty_store_url(request, tmp_path))
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


PRIORITY = {"otp": 0, "transactional": 1, "bulk": 2, "other": 3}
LEASE = 30.0


def queued(
    key: str, zone: str = "acme", now: float = NOW, lane: str = "transactional", due: float | None = None
) -> Record:
    sub = Submission(
        zone, key, f"fp:{key}", f"att:{key}", "inst-1", f"<{key}@test>", lane=lane, max_age=3 * DAY
    )
    verdict = ledger.decide(None, sub, now, LedgerSettings())
    assert isinstance(verdict, ledger.Proceed) and verdict.record.state is State.QUEUED
    return replace(verdict.record, next_attempt_at=now if due is None else due)


def body(key: str, lane: str = "transactional") -> QueuedMessage:
    # Not UTF-8 on purpose: an 8BITMIME body in Latin-1 must come back byte for byte.
    content = f"Subject: {key}\r\n\r\n".encode() + b"caf\xe9 \xff\x00\r\n"
    return QueuedMessage("billing@acme.example", ("a@example.com", "B@example.com"), content, PRIORITY[lane])


async def put_queued(store: Store, *recs: Record) -> None:
    for rec in recs:
        assert await store.enqueue(rec, None, body(rec.key, rec.lane or "")) is None


def keys_of(claimed: list[Claimed]) -> list[str]:
    return [c.record.key for c in claimed]


def cap(token: str, now: float = NOW, hourly: int = 10, monthly: int = 1000, zone: str = "acme") -> CapCheck:
    return cap_check(zone, Caps(hourly, monthly), token, now)


# --- ledger ----------------------------------------------------------------------------------
async def test_ping(store: Store) -> None:
    assert await store.ping() is True


async def test_circuits_are_published_per_instance_and_provider(store: Store) -> None:
    assert await store.circuits() == []
    await store.set_circuit("a", "primary", "open", 100.0)
    await store.set_circuit("b", "primary", "closed", 101.0)
    await store.set_circuit("a", "primary", "half_open", 102.0)
    got = [(c.instance, c.provider, c.circuit, c.at) for c in await store.circuits()]
    assert got == [("a", "primary", "half_open", 102.0), ("b", "primary", "closed", 101.0)]


async def test_probes_are_published_per_instance_and_provider(store: Store) -> None:
    assert await store.probes() == []
    await store.set_probe("a", "standby", True, "connect, EHLO, QUIT ok", 100.0)
    await store.set_probe("b", "standby", False, "AUTH: 535 5.7.8 bad", 101.0)
    await store.set_probe("a", "standby", False, "connect: refused", 102.0)
    got = [(p.instance, p.provider, p.ready, p.detail, p.at) for p in await store.probes()]
    assert got == [
        ("a", "standby", False, "connect: refused", 102.0),
        ("b", "standby", False, "AUTH: 535 5.7.8 bad", 101.0),
    ]


async def test_suppression_versions_move_on_every_change(store: Store) -> None:
    assert await store.suppression_versions("acme") == (0, 0)
    await store.suppress_add("acme", "a@example.com", "r", 1.0)
    own, shared = await store.suppression_versions("acme")
    assert own >= 1 and shared == 0
    await store.suppress_add("global", "g@example.com", "r", 1.0)
    await store.suppress_remove("acme", "a@example.com")
    own2, shared2 = await store.suppression_versions("acme")
    assert own2 > own and shared2 > shared
    assert (await store.suppression_versions("globex"))[0] == 0


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


async def test_caps_larger_than_the_concurrency_are_exact_too(store: Store) -> None:
    # Far from a cap a backend may count without taking every lock of the zone (PostgreSQL
    # spreads a zone's count over slots): the last units before the cap are still exact.
    hourly = await asyncio.gather(
        *(store.reserve(fresh(f"h{i}"), None, cap(f"th{i}", hourly=40), False) for i in range(100))
    )
    assert hourly.count(Reserved()) == 40
    monthly = await asyncio.gather(
        *(store.consume_cap(cap(f"tm{i}", hourly=1000, monthly=85)) for i in range(100))
    )
    assert monthly.count(None) == 45
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(85, 85)


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
    # Entries are kept and compared case-folded (policy/senders.suppression_key): a list
    # exists so that nobody who bounced is mailed again, whatever case the app writes.
    assert await store.suppress_list("acme") == [
        Suppression("acme", "a@example.com", "manual", NOW + 2),
        Suppression("acme", "user@example.com", "bounced", NOW),
    ]
    assert await store.suppress_list("globex") == []
    assert await store.suppressed("acme", "User@example.com") == "acme"
    assert await store.suppressed("acme", "User@Example.Com") == "acme"
    assert await store.suppressed("acme", "user@example.com") == "acme"
    assert await store.suppressed("globex", "User@example.com") is None
    assert await store.suppress_remove("acme", "user@EXAMPLE.COM") is True
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


# --- store-and-forward queue -----------------------------------------------------------------
async def test_enqueue_writes_the_record_and_the_message(store: Store) -> None:
    rec = queued("q1")
    assert await store.enqueue(rec, None, body("q1")) is None
    assert await store.get("acme", "q1") == rec
    assert await store.queue_entries("acme") == [
        QueueEntry("acme", "q1", "transactional", "queued", NOW, False, NOW, len(body("q1").content))
    ]
    assert await store.claim(NOW, [("transactional", 5)], LEASE) == [Claimed(rec, body("q1"))]


async def test_enqueue_is_compare_and_swap(store: Store) -> None:
    rec = queued("q1")
    assert await store.enqueue(rec, None, body("q1")) is None
    rival = replace(queued("q1"), sg_id="att:rival")
    other = QueuedMessage("billing@acme.example", ("c@example.com",), b"rival", 1)
    assert await store.enqueue(rival, None, other) == Conflict(rec)
    assert await store.enqueue(queued("q2"), 4, body("q2")) == Conflict(None)
    assert await store.get("acme", "q1") == rec
    assert await store.get("acme", "q2") is None
    # The loser's message was not kept either.
    assert await store.claim(NOW, [("transactional", 5)], LEASE) == [Claimed(rec, body("q1"))]
    # Over the expected version, the entry is replaced, claim and all.
    again = replace(rec, version=2, updated_at=NOW + 1, next_attempt_at=NOW + 1)
    assert await store.enqueue(again, 1, other) is None
    assert await store.claim(NOW + 1, [("transactional", 5)], LEASE) == [Claimed(again, other)]


async def test_claim_takes_only_due_entries_oldest_first(store: Store) -> None:
    await put_queued(store, queued("late", due=NOW + 20), queued("soon", due=NOW + 10), queued("now"))
    assert await store.claim(NOW - 1, [("transactional", 5)], LEASE) == []
    assert keys_of(await store.claim(NOW + 10, [("transactional", 5)], LEASE)) == ["now", "soon"]
    assert keys_of(await store.claim(NOW + 19.9, [("transactional", 5)], LEASE)) == []
    assert keys_of(await store.claim(NOW + 20, [("transactional", 5)], LEASE)) == ["late"]


async def test_claim_respects_quotas_and_lane_order(store: Store) -> None:
    for lane in ("bulk", "otp", "transactional"):
        await put_queued(store, *(queued(f"{lane}{i}", lane=lane, due=NOW + i) for i in range(3)))
    await put_queued(store, queued("other0", lane="other"))
    quotas = [("otp", 2), ("transactional", 1), ("bulk", 1)]
    first = await store.claim(NOW + 5, quotas, LEASE)
    assert keys_of(first) == ["otp0", "otp1", "transactional0", "bulk0"]
    assert [c.message.priority for c in first] == [0, 0, 1, 2]
    second = await store.claim(NOW + 5, quotas, LEASE)
    assert keys_of(second) == ["otp2", "transactional1", "bulk1", "transactional2"]
    assert keys_of(await store.claim(NOW + 5, quotas, LEASE)) == ["bulk2"]
    # A lane no quota names is never served.
    assert await store.claim(NOW + 5, quotas, LEASE) == []
    assert await store.claim(NOW + 5, [], LEASE) == []
    assert await store.claim(NOW + 5, [("other", 0)], LEASE) == []


async def test_claim_fills_what_a_lane_cannot_use_from_the_others(store: Store) -> None:
    await put_queued(store, queued("otp0", lane="otp"))
    for lane in ("transactional", "bulk"):
        await put_queued(store, *(queued(f"{lane}{i}", lane=lane, due=NOW + i) for i in range(5)))
    quotas = [("otp", 3), ("transactional", 2), ("bulk", 1)]
    got = await store.claim(NOW + 10, quotas, LEASE)
    # Quotas first (otp has only one), then the two spare slots from the lanes in order.
    assert keys_of(got) == [
        "otp0",
        "transactional0",
        "transactional1",
        "bulk0",
        "transactional2",
        "transactional3",
    ]
    got = await store.claim(NOW + 10, quotas, LEASE)
    assert keys_of(got) == ["transactional4", "bulk1", "bulk2", "bulk3", "bulk4"]


async def test_claim_serves_zones_by_due_time(store: Store) -> None:
    for i in range(6):
        zone = "acme" if i % 2 == 0 else "globex"
        await put_queued(store, queued(f"{zone}{i}", zone=zone, due=NOW + i))
    first = await store.claim(NOW + 10, [("transactional", 4)], LEASE)
    assert [(c.record.zone, c.record.key) for c in first] == [
        ("acme", "acme0"),
        ("globex", "globex1"),
        ("acme", "acme2"),
        ("globex", "globex3"),
    ]
    assert keys_of(await store.claim(NOW + 10, [("transactional", 4)], LEASE)) == ["acme4", "globex5"]


async def test_a_claim_hides_the_entry_until_its_lease_passes(store: Store) -> None:
    rec = queued("q1")
    await put_queued(store, rec)
    assert await store.claim(NOW, [("transactional", 5)], LEASE) == [Claimed(rec, body("q1"))]
    assert await store.claim(NOW + 1, [("transactional", 5)], LEASE) == []
    assert await store.claim(NOW + LEASE, [("transactional", 5)], LEASE) == []
    # The worker died: the entry comes back once its claim has expired, message and all.
    assert await store.claim(NOW + LEASE + 0.5, [("transactional", 5)], LEASE) == [Claimed(rec, body("q1"))]
    assert await store.claim(NOW + LEASE + 1, [("transactional", 5)], LEASE) == []


async def test_concurrent_claims_hand_out_each_entry_once(store: Store) -> None:
    recs = [
        queued(
            f"c{i}", zone=("acme", "globex")[i % 2], lane=("transactional", "bulk")[i % 3 == 0], due=NOW + i
        )
        for i in range(10)
    ]
    await put_queued(store, *recs)
    quotas = [("transactional", 1), ("bulk", 1)]
    results = await asyncio.gather(*(store.claim(NOW + 10, quotas, LEASE) for _ in range(20)))
    handed = Counter((c.record.zone, c.record.key) for got in results for c in got)
    print(
        f"claim race: 20 claimers, 10 entries → {sum(handed.values())} handed out, max {max(handed.values())}"
    )
    assert handed == Counter((r.zone, r.key) for r in recs)
    assert all(len(got) <= 2 for got in results)
    assert await store.claim(NOW + 10, quotas, LEASE) == []


async def test_requeue_without_due_takes_the_entry_off_the_queue(store: Store) -> None:
    rec = queued("q1")
    await put_queued(store, rec)
    [claimed] = await store.claim(NOW, [("transactional", 5)], LEASE)
    done = settled(claimed.record, NOW + 1)
    assert await store.requeue(done, 1, None) is None
    assert await store.get("acme", "q1") == done
    assert await store.queue_entries("acme") == []
    assert await store.queue_entries(None) == []
    assert await store.claim(NOW + 10 * LEASE, [("transactional", 5)], LEASE) == []


async def test_requeue_with_a_due_time_makes_it_due_again_and_unclaimed(store: Store) -> None:
    rec = queued("q1")
    await put_queued(store, rec)
    await store.claim(NOW, [("transactional", 5)], 10 * LEASE)
    later = replace(rec, state=State.DEFERRED, version=2, updated_at=NOW + 1, next_attempt_at=NOW + 60)
    assert await store.requeue(later, 1, NOW + 60) is None
    [entry] = await store.queue_entries("acme")
    assert (entry.state, entry.due_at, entry.claimed) == ("deferred", NOW + 60, False)
    assert await store.claim(NOW + 59, [("transactional", 5)], LEASE) == []
    # Due again before the old claim (10 leases) would have run out: requeue cleared it.
    assert await store.claim(NOW + 60, [("transactional", 5)], LEASE) == [Claimed(later, body("q1"))]


async def test_requeue_is_compare_and_swap(store: Store) -> None:
    rec = queued("q1")
    await put_queued(store, rec)
    [claimed] = await store.claim(NOW, [("transactional", 5)], LEASE)
    stale = replace(rec, state=State.DEFERRED, version=3, updated_at=NOW + 1)
    assert await store.requeue(stale, 2, None) == Conflict(rec)
    assert await store.requeue(stale, 2, NOW) == Conflict(rec)
    assert await store.requeue(queued("ghost"), 1, None) == Conflict(None)
    assert await store.get("acme", "q1") == rec
    # Neither write touched the entry: still queued, still claimed.
    [entry] = await store.queue_entries("acme")
    assert entry.key == "q1" and entry.due_at == NOW
    assert await store.claim(NOW + 1, [("transactional", 5)], LEASE) == []
    assert await store.claim(NOW + LEASE + 1, [("transactional", 5)], LEASE) == [claimed]


async def test_held_entries_are_never_due(store: Store) -> None:
    rec = queued("q1")
    await put_queued(store, rec, queued("q2", due=HELD))
    await store.claim(NOW, [("transactional", 5)], LEASE)
    lost = replace(rec, state=State.UNKNOWN, version=2, updated_at=NOW + 1)
    assert await store.requeue(lost, 1, HELD) is None
    for t in (NOW + 10 * DAY, 1e17, HELD - 1e3):
        assert await store.claim(t, [("transactional", 5)], LEASE) == []
    entries = await store.queue_entries("acme")
    assert [(e.key, e.state, e.due_at, e.claimed) for e in entries] == [
        ("q1", "unknown", None, False),
        ("q2", "queued", None, False),
    ]
    # Kept whole for the operator.
    assert [e.size for e in entries] == [len(body("q1").content), len(body("q2").content)]


async def test_queue_entries_list_every_zone_with_state(store: Store) -> None:
    t = time.time()
    await put_queued(
        store,
        queued("b1", lane="bulk", now=t),
        queued("t1", now=t, due=t + 5),
        queued("o1", lane="otp", now=t, due=t + 9),
        queued("g1", zone="globex", now=t, due=t + 1),
    )
    [claimed] = await store.claim(t, [("bulk", 1)], 3600)
    assert claimed.record.key == "b1"
    entries = await store.queue_entries(None)
    assert [(e.zone, e.key, e.lane, e.state, e.due_at, e.claimed) for e in entries] == [
        ("acme", "o1", "otp", "queued", t + 9, False),
        ("globex", "g1", "transactional", "queued", t + 1, False),
        ("acme", "t1", "transactional", "queued", t + 5, False),
        ("acme", "b1", "bulk", "queued", t, True),
    ]
    assert all(e.enqueued_at == t and e.size == len(body(e.key).content) for e in entries)
    assert [e.key for e in await store.queue_entries("globex")] == ["g1"]
    assert await store.queue_entries("initech") == []


async def test_queue_entries_read_a_claim_on_the_stores_clock(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host that lists the queue (an operator's CLI, resume's wake of held entries) has
    a wall clock an hour ahead: an entry is listed as claimed exactly while its claim is
    live on the store's clock (DESIGN.md §11.5). On a server's clock (Redis, PostgreSQL)
    the claim is still live; SQLite's clock is the host's (one machine), so it is over."""
    t = store.now()
    await put_queued(store, queued("c1", now=t))
    [claimed] = await store.claim(t, [("transactional", 1)], LEASE)
    assert claimed.record.key == "c1"
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + HOUR)
    live = t + LEASE > store.now()
    assert live is not isinstance(store, SQLiteStore)
    [entry] = await store.queue_entries("acme")
    assert entry.claimed is live


async def test_an_entry_whose_record_was_purged_is_dropped(store: Store) -> None:
    rec = replace(queued("q1"), state=State.DEFERRED)
    await put_queued(store, rec, queued("q2"))
    await store.requeue(replace(queued("q2"), state=State.DELIVERED, version=2), 1, None)
    assert await store.purge(NOW + RETENTION + 1, RETENTION) == 2
    assert await store.claim(NOW + RETENTION + 1, [("transactional", 5)], LEASE) == []
    assert await store.queue_entries(None) == []


async def test_purge_keeps_a_deferred_entry_waiting_in_its_lane_within_its_max_age(store: Store) -> None:
    """A class kept longer than the retention (max_age 90 days) and a next try further off
    than the retention (a long backoff, or every instance down for a week): the entry,
    answered `250 queued` once, waits in its lane, its record untouched since its last
    try. The purge must not take it (DESIGN.md §11.2), as it does not take a queued one;
    past its max_age it may go, as before."""
    later = NOW + RETENTION + 1
    waiting = replace(
        queued("waiting"), state=State.DEFERRED, expires_at=NOW + 90 * DAY, next_attempt_at=later + 60
    )
    stale = replace(queued("stale"), state=State.DEFERRED, next_attempt_at=later + 60)  # max_age 3 days
    relay_deferred = settled(fresh("relay-deferred"), NOW, State.DEFERRED)  # no lane: settled
    await put_queued(store, waiting, stale)
    assert await store.reserve(fresh("relay-deferred"), None, None, False) == Reserved()
    assert await store.put(relay_deferred, 1) is None

    assert await store.purge(later, RETENTION) == 2
    assert await store.get("acme", "waiting") == waiting
    assert await store.get("acme", "stale") is None
    assert await store.get("acme", "relay-deferred") is None
    [claimed] = await store.claim(later + 60, [("transactional", 5)], LEASE)
    assert claimed.record == waiting and claimed.message == body("waiting")
    # Once expired by its worker it is settled like any other record.
    gone = replace(waiting, state=State.EXPIRED, version=waiting.version + 1, updated_at=later + 60)
    assert await store.requeue(gone, waiting.version, None) is None
    assert await store.purge(later + 60 + RETENTION + 1, RETENTION) == 1
    assert await store.get("acme", "waiting") is None


async def test_purge_takes_exactly_the_settled_records_and_their_entries(store: Store) -> None:
    """The purge's rule at each of its edges, counted: an old record goes unless it is in
    flight, queued, or deferred with its message still in its lane before its max_age
    (`expires_at` later than now; none: never). One updated exactly at the cutoff, or
    expiring exactly now, is on the near side of each edge. An entry goes with its record."""
    later = NOW + RETENTION + 1
    deferred = State.DEFERRED
    in_lane = {
        key: replace(queued(key), state=state, expires_at=expires)
        for key, state, expires in (
            ("deferred-expiring-later", deferred, later + 1),
            ("deferred-never-expiring", deferred, None),
            ("deferred-expiring-now", deferred, later),
            ("deferred-expired", deferred, later - 1),
            ("queued-expired", State.QUEUED, later - 1),
            ("in-flight-claimed", State.IN_FLIGHT, later - 1),
            ("unknown-held", State.UNKNOWN, None),
            ("failed-held", State.FAILED, None),
        )
    }
    await put_queued(store, *in_lane.values())
    no_lane = {
        "relay-deferred-expiring-later": replace(
            settled(fresh("relay-deferred-expiring-later"), NOW, State.DEFERRED), expires_at=later + 1
        ),
        "relay-deferred-never-expiring": settled(fresh("relay-deferred-never-expiring"), NOW, State.DEFERRED),
        "delivered": settled(fresh("delivered"), NOW),
        "unknown-at-the-cutoff": settled(fresh("unknown-at-the-cutoff"), later - RETENTION, State.UNKNOWN),
        "in-flight": fresh("in-flight"),
    }
    for key, rec in no_lane.items():
        assert await store.reserve(fresh(key), None, None, False) == Reserved()
        if rec.version > 1:
            assert await store.put(rec, 1) is None
    kept = {
        "deferred-expiring-later",
        "deferred-never-expiring",
        "queued-expired",
        "in-flight-claimed",
        "unknown-at-the-cutoff",
        "in-flight",
    }
    everything = {**in_lane, **no_lane}

    assert await store.purge(later, RETENTION) == len(everything) - len(kept) == 7
    assert {key for key in everything if await store.get("acme", key) is not None} == kept
    assert sorted(e.key for e in await store.queue_entries(None)) == sorted(kept & in_lane.keys())
    assert await store.purge(later, RETENTION) == 0


async def test_consume_cap_is_exact_under_concurrency(store: Store) -> None:
    results = await asyncio.gather(*(store.consume_cap(cap(f"t{i}", NOW + i, hourly=10)) for i in range(30)))
    won = [i for i, res in enumerate(results) if res is None]
    assert len(won) == 10
    assert [res for res in results if res is not None] == [CapReached("hour", 10, NOW + min(won) + HOUR)] * 20
    assert await store.cap_usage("acme", NOW + 30, MONTH) == CapUsage(10, 10)
    # The same counters as reserve(): one cap, whichever path consumes it.
    assert await store.reserve(fresh("k1"), None, cap("t99", NOW + 30, hourly=10), False) == CapReached(
        "hour", 10, NOW + min(won) + HOUR
    )
    await store.refund("acme", f"t{won[0]}", MONTH)
    assert await store.consume_cap(cap("t100", NOW + 31, hourly=10)) is None
    assert await store.consume_cap(cap("t101", NOW + 31, hourly=10)) == CapReached(
        "hour", 10, NOW + sorted(won)[1] + HOUR
    )


async def test_consume_cap_monthly_is_exact_under_concurrency(store: Store) -> None:
    results = await asyncio.gather(
        *(store.consume_cap(cap(f"t{i}", hourly=100, monthly=7, zone="globex")) for i in range(30))
    )
    assert results.count(None) == 7
    assert results.count(CapReached("month", 7)) == 23
    assert await store.cap_usage("globex", NOW, MONTH) == CapUsage(7, 7)
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(0, 0)


# --- stream controls (DESIGN.md §16) --------------------------------------------------------
def user_cap(
    token: str, user: str, now: float = NOW, hourly: int = 5, monthly: int = 1000, zone_hourly: int = 100
) -> CapCheck:
    return cap_check("acme", Caps(zone_hourly, 1000), token, now, user, Caps(hourly, monthly))


async def test_user_cap_is_exact_under_concurrency_inside_the_zone_cap(store: Store) -> None:
    results = await asyncio.gather(
        *(
            store.reserve(fresh(f"k{i}", now=NOW + i), None, user_cap(f"t{i}", "svc", NOW + i), False)
            for i in range(30)
        )
    )
    won = [i for i, res in enumerate(results) if isinstance(res, Reserved)]
    assert len(won) == 5
    refused = [res for res in results if not isinstance(res, Reserved)]
    assert refused == [CapReached("hour", 5, NOW + min(won) + HOUR, user="svc")] * 25
    for i in range(30):
        assert (await store.get("acme", f"k{i}") is not None) == (i in won)
    # Each unit counted once under the zone and once under the user, never more.
    assert await store.cap_usage("acme", NOW + 30, MONTH) == CapUsage(5, 5)
    assert await store.user_cap_usage("acme", ["svc"], NOW + 30, MONTH) == {"svc": CapUsage(5, 5)}
    # Another user of the zone still sends; the zone's cap (7) still holds over both.
    other = [
        await store.reserve(fresh(f"o{i}"), None, user_cap(f"o{i}", "other", NOW + 31, zone_hourly=7), False)
        for i in range(4)
    ]
    assert other[:2] == [Reserved(), Reserved()]
    assert other[2:] == [CapReached("hour", 7, NOW + min(won) + HOUR)] * 2
    # The zone's refusal took no unit of the user's.
    assert await store.user_cap_usage("acme", ["other", "svc"], NOW + 31, MONTH) == {
        "other": CapUsage(2, 2),
        "svc": CapUsage(5, 5),
    }


async def test_user_monthly_cap_names_the_user(store: Store) -> None:
    results = await asyncio.gather(
        *(
            store.reserve(fresh(f"k{i}"), None, user_cap(f"t{i}", "svc", hourly=100, monthly=3), False)
            for i in range(12)
        )
    )
    assert results.count(Reserved()) == 3
    assert results.count(CapReached("month", 3, user="svc")) == 9
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(3, 3)


async def test_a_refund_returns_the_user_unit_with_the_zone_unit(store: Store) -> None:
    assert await store.reserve(fresh("k1"), None, user_cap("t1", "svc", hourly=1), False) == Reserved()
    assert await store.reserve(fresh("k2"), None, user_cap("t2", "svc", hourly=1), False) == CapReached(
        "hour", 1, NOW + HOUR, user="svc"
    )
    await store.refund("acme", "t1", MONTH)
    await store.refund("acme", "t1", MONTH)  # twice: one unit back, not two
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(0, 0)
    assert await store.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(0, 0)}
    assert await store.reserve(fresh("k2"), None, user_cap("t2", "svc", hourly=1), False) == Reserved()
    assert await store.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(1, 1)}


async def test_consume_cap_counts_the_user_unit_exactly_and_once(store: Store) -> None:
    results = await asyncio.gather(
        *(store.consume_cap(user_cap(f"t{i}", "svc", hourly=4)) for i in range(20))
    )
    assert results.count(None) == 4
    assert results.count(CapReached("hour", 4, NOW + HOUR, user="svc")) == 16
    won = [i for i, res in enumerate(results) if res is None]
    # A call run again after its reply was lost counts nothing more.
    assert await store.consume_cap(user_cap(f"t{won[0]}", "svc", hourly=4)) is None
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(4, 4)
    assert await store.user_cap_usage("acme", ["svc", "idle"], NOW, MONTH) == {
        "svc": CapUsage(4, 4),
        "idle": CapUsage(0, 0),
    }
    # reserve and consume_cap share the user's counters.
    assert await store.reserve(fresh("k1"), None, user_cap("t99", "svc", hourly=4), False) == CapReached(
        "hour", 4, NOW + HOUR, user="svc"
    )


async def test_redis_user_cap_keys_share_the_zone_slot_and_the_purge_trims_their_tokens(
    redis_server: RedisServer,
) -> None:
    plain = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await plain.flushall()
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        assert await s.reserve(fresh("k1"), None, user_cap("t1", "svc"), False) == Reserved()
        assert await s.consume_cap(user_cap("t2", "svc", NOW + 1)) is None
        user_keys = [str(k) for k in await plain.keys("sg:{acme}:u*")]
        # The user's window, its month and the token map: one Cluster slot with the zone's.
        assert len(user_keys) == 3
        assert {key_slot(k.encode()) for k in user_keys} == {key_slot(b"acme")}
        assert await plain.hlen("sg:{acme}:utok") == 2
        await s.purge(NOW + 3 * HOUR, RETENTION)
        assert await plain.hlen("sg:{acme}:utok") == 0
    finally:
        await s.close()
        await plain.aclose()


async def test_redis_user_windows_expire_once_the_user_stops_sending(redis_server: RedisServer) -> None:
    """The zone's window is trimmed by the purge, which knows the zones; a user's window has
    no such list (a user renamed or removed by a reload is never named again), so it must
    expire by itself once past any window that reads it."""
    plain = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await plain.flushall()
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        assert await s.reserve(fresh("k1"), None, user_cap("t1", "svc"), False) == Reserved()
        assert await s.consume_cap(user_cap("t2", "gone", NOW + 1)) is None
        ttls = [await plain.ttl(f"sg:{{acme}}:us:{user}") for user in ("svc", "gone")]
    finally:
        await s.close()
        await plain.aclose()
    assert all(HOUR < ttl <= 2 * HOUR for ttl in ttls), ttls


async def test_a_paused_class_is_listed_until_resumed(store: Store) -> None:
    assert await store.paused_classes() == set()
    await store.set_class_paused("acme", "bulk", True)
    await store.set_class_paused("acme", "bulk", True)  # idempotent
    await store.set_class_paused("globex", "otp", True)
    assert await store.paused_classes() == {("acme", "bulk"), ("globex", "otp")}
    # A class pause is not the zone's kill switch.
    assert await store.is_paused("acme") is False
    await store.set_class_paused("acme", "bulk", False)
    await store.set_class_paused("acme", "bulk", False)
    assert await store.paused_classes() == {("globex", "otp")}


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
        # a hang guard, not a measure: each call answers StoreUnavailable, none waits for Redis
        async with asyncio.timeout(30):
            with pytest.raises(StoreUnavailable):
                await s.reserve(fresh("k1"), None, cap("t1"), False)
            with pytest.raises(StoreUnavailable):
                await s.get("acme", "k1")
            with pytest.raises(StoreUnavailable):
                await s.put(fresh("k1"), 1)
            with pytest.raises(StoreUnavailable):
                await s.suppressed("acme", "a@example.com")
            assert await s.ping() is False
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
        async with asyncio.timeout(30):  # a hang guard, as above
            with pytest.raises(StoreUnavailable):
                await s.get("acme", "k1")
            with pytest.raises(StoreUnavailable):
                await s.reserve(fresh("k2"), None, cap("t2"), False)
            assert await s.ping() is False

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
        # record, index, ids, its state's set, sends, month, paused, counts, suppression, its
        # change counter
        assert len(by_zone["acme"]) == len(by_zone["globex"]) == 10
        for zone, zone_keys in by_zone.items():
            assert {key_slot(k.encode()) for k in zone_keys} == {key_slot(zone.encode())}
        assert {
            k for k in keys if not any(k in v for v in by_zone.values()) and k not in UPGRADE_MARKERS
        } == {
            "sg:zones",
            "sg:{auth:192.0.2.1}:fail",
        }
    finally:
        await s.close()
        await plain.aclose()


async def test_redis_queue_keys_share_the_zone_slot_and_idle_zones_leave_the_claim(
    redis_server: RedisServer,
) -> None:
    plain = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await plain.flushall()
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        for zone in ("acme", "globex"):
            await put_queued(s, queued("k1", zone=zone), queued("k2", zone=zone, lane="bulk"))
        assert len(await s.claim(NOW, [("transactional", 2), ("bulk", 2)], LEASE)) == 4
        keys = [str(k) for k in await plain.keys("*")]
        by_zone = {z: [k for k in keys if f"{{{z}}}" in k] for z in ("acme", "globex")}
        # records, index, ids, the state's set, entries, lanes, claimed, claimers, queue, the set
        # of lane names
        assert len(by_zone["acme"]) == len(by_zone["globex"]) == 13
        for zone, zone_keys in by_zone.items():
            assert {key_slot(k.encode()) for k in zone_keys} == {key_slot(zone.encode())}
        assert {k for k in keys if "{" not in k} - UPGRADE_MARKERS == {"sg:zones", "sg:queued-zones"}

        # acme's queue empties: the next claim stops looking at acme.
        for key in ("k1", "k2"):
            rec = await s.get("acme", key)
            assert rec is not None
            assert await s.requeue(settled(rec, NOW + 1), rec.version, None) is None
        assert len(await s.claim(NOW + 2 * LEASE, [("transactional", 5), ("bulk", 5)], LEASE)) == 2
        assert await plain.smembers("sg:queued-zones") == {"globex"}
        assert await plain.exists("sg:{acme}:lane:transactional", "sg:{acme}:claimed", "sg:{acme}:queue") == 0

        # An enqueue that died before listing its zone: a new process finds the zone anyway.
        await put_queued(s, queued("k3"))
        await plain.srem("sg:queued-zones", "acme")
        fresh_process = RedisStore(redis_server.url)
        await fresh_process.open()
        try:
            assert keys_of(await fresh_process.claim(NOW + 4 * LEASE, [("transactional", 5)], LEASE)) == [
                "k3",
                "k1",
            ]
        finally:
            await fresh_process.close()
        assert await plain.smembers("sg:queued-zones") == {"acme", "globex"}

        # Redis lost its script cache (restart, SCRIPT FLUSH): the byte-exact claim reloads it.
        await plain.script_flush()
        rec = await s.get("globex", "k2")
        assert rec is not None
        assert await s.requeue(rec, rec.version, NOW) is None
        assert await s.claim(NOW + 4 * LEASE, [("bulk", 5)], LEASE) == [Claimed(rec, body("k2", "bulk"))]
    finally:
        await s.close()
        await plain.aclose()


async def test_redis_commands_cancelled_midway_leave_no_connection_out_of_step(
    redis_server: RedisServer,
) -> None:
    """A ledger write cancelled between its request and its reply (the operation deadline,
    a client gone) must not leave that reply on a pooled connection for the next command to
    read as its own."""
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        rng = random.Random(20261129)
        for i in range(300):
            task = asyncio.ensure_future(s.put(fresh(f"cx{i}", zone="globex"), None))
            # Cancel at varying points: before the write, between write and reply, or never.
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Every later command reads its own reply: each put of a new key succeeds, each get
        # returns that key's record.
        for i in range(300):
            assert await s.put(fresh(f"after{i}", zone="globex"), None) is None
            got = await s.get("globex", f"after{i}")
            assert got is not None and got.key == f"after{i}"
    finally:
        await s.close()


# --- a retried call recognises its own write (DESIGN.md §11.4) --------------------------------
async def test_a_reserve_run_twice_is_one_reservation_and_one_unit(store: Store) -> None:
    # The reply of the first run was lost (connection reset after the script ran): the
    # caller runs the same call again.
    rec = fresh("k1")
    assert await store.reserve(rec, None, cap("t1"), False) == Reserved()
    assert await store.reserve(rec, None, cap("t1"), False) == Reserved()
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(1, 1)
    # Even when the zone was paused in between: the first run's write stands.
    await store.set_paused("acme", True)
    assert await store.reserve(rec, None, cap("t1"), False) == Reserved()
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(1, 1)
    # A retry over an existing version, likewise.
    later = replace(settled(rec, NOW + 1, State.DEFERRED))
    assert await store.put(later, rec.version) is None
    again = replace(later, state=State.IN_FLIGHT, version=later.version + 1, sg_id="att:k1b")
    await store.set_paused("acme", False)
    assert await store.reserve(again, later.version, cap("t2"), False) == Reserved()
    assert await store.reserve(again, later.version, cap("t2"), False) == Reserved()
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(2, 2)
    # A different record at the same version is still a conflict.
    rival = replace(again, sg_id="att:rival")
    got = await store.reserve(rival, later.version, cap("t3"), False)
    assert isinstance(got, Conflict) and got.current == again


async def test_a_put_run_twice_is_written_once_and_a_rival_still_conflicts(store: Store) -> None:
    rec = fresh("k1")
    assert await store.put(rec, None) is None
    assert await store.put(rec, None) is None  # own write, reply lost: not a lost lease
    noted = replace(rec, phase=ledger.Phase.DATA_SENT, version=rec.version + 1, updated_at=NOW + 1)
    assert await store.put(noted, rec.version) is None
    assert await store.put(noted, rec.version) is None
    renewed = replace(noted, lease_until=NOW + 60, version=noted.version + 1)
    assert await store.put(renewed, noted.version) is None
    assert await store.put(renewed, noted.version) is None
    assert await store.get("acme", "k1") == renewed
    rival = replace(noted, owner="inst-2", version=noted.version + 1)
    got = await store.put(rival, noted.version)
    assert isinstance(got, Conflict) and got.current == renewed


async def test_consume_cap_run_twice_counts_one_unit(store: Store) -> None:
    assert await store.consume_cap(cap("t1", hourly=2)) is None
    assert await store.consume_cap(cap("t1", hourly=2)) is None
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(1, 1)
    assert await store.consume_cap(cap("t2", hourly=2)) is None
    assert await store.consume_cap(cap("t3", hourly=2)) == CapReached("hour", 2, NOW + HOUR)
    await store.refund("acme", "t1", MONTH)
    assert await store.cap_usage("acme", NOW, MONTH) == CapUsage(1, 1)


async def test_enqueue_and_requeue_run_twice(store: Store) -> None:
    rec = queued("k1")
    await put_queued(store, rec)
    assert await store.enqueue(rec, None, body("k1")) is None
    assert [e.key for e in await store.queue_entries("acme")] == ["k1"]
    done = settled(rec, NOW + 1)
    assert await store.requeue(done, rec.version, None) is None
    assert await store.requeue(done, rec.version, None) is None
    assert await store.queue_entries("acme") == []


async def test_queue_lanes_name_every_lane_with_entries(store: Store) -> None:
    assert await store.queue_lanes() == set()
    await put_queued(
        store, queued("k1"), queued("k2", lane="bulk"), queued("k3", zone="globex", lane="other")
    )
    assert await store.queue_lanes() == {"transactional", "bulk", "other"}
    k3 = await store.get("globex", "k3")
    assert k3 is not None
    assert await store.requeue(settled(k3, NOW + 1), k3.version, None) is None
    assert await store.queue_lanes() == {"transactional", "bulk"}


async def test_the_store_clock_is_the_epoch(store: Store) -> None:
    assert abs(store.now() - time.time()) < 1.0
    a = store.now()
    assert store.now() >= a


async def test_redis_clock_follows_redis_time_not_the_local_wall_clock(redis_server: RedisServer) -> None:
    """Two instances whose own clocks disagree by minutes read one clock: Redis's."""
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        plain = aioredis.Redis.from_url(redis_server.url)
        sec, usec = await plain.time()
        await plain.aclose()
        assert abs(s.now() - (sec + usec / 1e6)) < 0.05
        # This host's monotonic clock jumps 300 s (a suspended VM resumed): until the next
        # sample the store clock moves with it, and the sample brings it back, never backwards.
        real = s._mono
        s._mono = lambda: real() + 300.0
        ahead = s.now()
        await s.sync_clock()
        assert s.now() >= ahead
    finally:
        await s.close()


async def test_sqlite_has_no_durability_problem(tmp_path: Path) -> None:
    s = store_from_url(f"sqlite:///{tmp_path / 'state.db'}")
    await s.open()
    try:
        assert await s.durability_problems() == []
    finally:
        await s.close()


async def test_redis_durability_is_checked_setting_by_setting(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, durable=True)
    server.start()
    s = RedisStore(server.url)
    try:
        await s.open()
        assert await s.durability_problems() == []
        plain = aioredis.Redis.from_url(server.url, decode_responses=True)
        await plain.config_set("appendfsync", "everysec")
        await plain.config_set("maxmemory", "100mb")
        await plain.config_set("maxmemory-policy", "allkeys-lru")
        problems = await s.durability_problems()
        assert any("appendfsync" in p and "everysec" in p for p in problems)
        assert any("maxmemory-policy" in p and "allkeys-lru" in p for p in problems)
        await plain.config_set("appendonly", "no")
        assert any("appendonly" in p for p in await s.durability_problems())
        await plain.aclose()
    finally:
        await s.close()
        server.stop()


async def test_entries_stored_before_case_folding_are_rekeyed_at_open(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Lists written by an earlier version kept the local part's case; opening the store
    re-keys them once, so `Bob@x` listed then stops `bob@x` and can be removed as `bob@x`."""
    import sqlite3

    db = tmp_path / "state.db"
    first = store_from_url(f"sqlite:///{db}")
    await first.open()
    await first.close()
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO suppression VALUES ('acme', 'Bob@example.com', 'old', 1.0)")
        c.execute("INSERT INTO suppression VALUES ('acme', 'J\u00d6E@example.com', 'old', 1.0)")
    plain = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await plain.flushall()
    await plain.sadd("sg:zones", "acme")
    await plain.hset("sg:{acme}:supp", "Bob@example.com", '{"reason":"old","at":1.0}')
    await plain.hset("sg:{acme}:supp", "J\u00d6E@example.com", '{"reason":"old","at":1.0}')
    await plain.aclose()
    for url in (f"sqlite:///{db}", redis_server.url):
        s = store_from_url(url)
        await s.open()
        try:
            # At once, as listed (Redis folds in the background, page by page).
            assert await s.suppressed("acme", "Bob@example.com") == "acme"
            want = ["bob@example.com", "j\u00f6e@example.com"]
            deadline = time.monotonic() + 5
            while [e.address for e in await s.suppress_list("acme")] != want:
                assert time.monotonic() < deadline, "the lists were not re-keyed"
                await asyncio.sleep(0.05)
            assert await s.suppressed("acme", "bob@example.com") == "acme"
            assert await s.suppress_remove("acme", "BOB@example.com") is True
        finally:
            await s.close()


async def test_a_queued_message_keeps_its_smtputf8_declaration(store: Store) -> None:
    rec, plain = queued("k1"), queued("k2")
    utf8 = replace(body("k1"), smtputf8=True)
    assert await store.enqueue(rec, None, utf8) is None
    assert await store.enqueue(plain, None, body("k2")) is None
    got = {c.record.key: c.message for c in await store.claim(NOW, [("transactional", 2)], LEASE)}
    assert got == {"k1": utf8, "k2": body("k2")}


async def test_a_sqlite_file_from_before_the_smtputf8_column_is_upgraded_at_open(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "old.db"
    with sqlite3.connect(db) as c:
        c.execute(
            "CREATE TABLE queue (zone TEXT NOT NULL, key TEXT NOT NULL, lane TEXT NOT NULL, "
            "priority INTEGER NOT NULL, due_at REAL NOT NULL, claimed_until REAL, enqueued_at REAL NOT NULL, "
            "sender TEXT NOT NULL, recipients TEXT NOT NULL, content BLOB NOT NULL, "
            "PRIMARY KEY (zone, key)) WITHOUT ROWID"
        )
    s = store_from_url(f"sqlite:///{db}")
    await s.open()
    try:
        await put_queued(s, queued("k1"))
        (claimed,) = await s.claim(NOW, [("transactional", 1)], LEASE)
        assert claimed.message == body("k1") and claimed.message.smtputf8 is False
    finally:
        await s.close()


async def test_redis_lanes_of_entries_queued_by_an_earlier_version_are_found(
    redis_server: RedisServer,
) -> None:
    plain = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await plain.flushall()
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        await put_queued(s, queued("k1", lane="bulk"))
    finally:
        await s.close()
    # As an earlier version left it: no set of lane names, no marker.
    await plain.delete("sg:{acme}:lanes", "sg:lanes-listed")
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        deadline = time.monotonic() + 5
        while await s.queue_lanes() != {"bulk"}:
            assert time.monotonic() < deadline, "the lane of an earlier entry was not found"
            await asyncio.sleep(0.05)
    finally:
        await s.close()
        await plain.aclose()


# --- provider events (DESIGN.md §13) ----------------------------------------------------------
def provider_event(
    event_id: str, recipient: str = "gone@example.net", at: float = NOW, source: str = "mg"
) -> StoredEvent:
    return StoredEvent(at, source, "bounce", "failed/permanent", recipient, "550", event_id, "suppressed", at)


async def test_records_are_found_by_message_id_in_either_form_and_by_upstream_id(store: Store) -> None:
    rec = fresh("inv-1")  # Message-ID <inv-1@test>
    assert await store.reserve(rec, None, None, False) == Reserved()
    assert [r.key for r in await store.find_records("message_id", "<inv-1@test>")] == ["inv-1"]
    assert [r.key for r in await store.find_records("message_id", " inv-1@test ")] == ["inv-1"]
    assert await store.find_records("upstream_id", "Q1") == []
    done = replace(settled(rec, NOW + 1), upstream_id="Q1")
    assert await store.put(done, 1) is None
    assert [r.key for r in await store.find_records("upstream_id", "Q1")] == ["inv-1"]
    # The record moved on to another attempt's id: the old one no longer finds it.
    again = replace(done, version=3, upstream_id="Q2")
    assert await store.put(again, 2) is None
    assert await store.find_records("upstream_id", "Q1") == []
    assert [r.key for r in await store.find_records("upstream_id", "Q2")] == ["inv-1"]
    assert await store.find_records("message_id", "<other@test>") == []


async def test_a_message_id_in_two_zones_finds_both(store: Store) -> None:
    for zone in ("acme", "globex"):
        rec = replace(fresh("k", zone=zone), message_id="<shared@x>")
        assert await store.reserve(rec, None, None, False) == Reserved()
    assert sorted(r.zone for r in await store.find_records("message_id", "shared@x")) == ["acme", "globex"]


def through(rec: Record, provider: str = "primary") -> Record:
    """The record with its attempt's outcome written: delivered by `provider`."""
    sent = ledger.Attempt(rec.sg_id, rec.updated_at, "inst-1", provider, "data_sent", "delivered")
    return replace(rec, attempts=(sent,))


async def test_a_message_id_shared_by_two_zones_matches_neither_however_many_share_it(store: Store) -> None:
    # 101 records of one zone hold the id before one of another zone: a limit of 100 rows
    # read before the one-zone rule would see only the first zone and match its record.
    for i in range(101):
        rec = through(replace(settled(fresh(f"k{i:03d}"), NOW + i), message_id="<shared@x>"))
        assert await store.reserve(rec, None, None, False) == Reserved()
    other = through(replace(settled(fresh("g", zone="globex"), NOW + 200), message_id="<shared@x>"))
    assert await store.reserve(other, None, None, False) == Reserved()
    assert await store.records_for_event("message_id", "shared@x") == []
    applier = Applier(store, lambda: {"acme", "globex"}, lambda: NOW + 300)
    bounce = ProviderEvent(
        "mg", EventKind.BOUNCE, "failed/permanent", "gone@example.net", "5.1.1", NOW + 250, "ev-1",
        Match(message_ids=("<shared@x>",)),
    )  # fmt: skip
    assert await applier.apply("primary", bounce) == (Applied.UNMATCHED, None)
    for zone in ("acme", "globex"):
        assert await store.suppress_list(zone) == []
    assert await store.provider_events("acme", "k000") == []
    assert await store.provider_events("globex", "g") == []
    # One zone only: its records, newest first.
    for i in range(3):
        rec = through(replace(settled(fresh(f"u{i}"), NOW + 400 + i), message_id="<one-zone@x>"))
        assert await store.reserve(rec, None, None, False) == Reserved()
    found = [r.key for r in await store.records_for_event("message_id", "<one-zone@x>")]
    assert found[0] == "u2" and sorted(found) == (
        ["u2"] if isinstance(store, RedisStore) else ["u0", "u1", "u2"]
    )


async def test_an_event_for_a_send_in_flight_is_retry_later_and_after_a_lost_lease_it_matches(
    store: Store,
) -> None:
    s = LedgerSettings()
    rec = fresh("k")
    assert await store.reserve(rec, None, None, False) == Reserved()
    sending = ledger.mark_data_sent(rec, rec.sg_id, NOW + 1, s, "primary")
    assert sending is not None and await store.put(sending, rec.version) is None
    applier = Applier(store, lambda: {"acme"}, lambda: NOW + 2)

    def bounce(event_id: str) -> ProviderEvent:
        return ProviderEvent(
            "mg", EventKind.BOUNCE, "failed/permanent", None, "5.1.1", NOW + 2, event_id,
            Match(keys=("acme:k",), message_ids=("<k@test>",)),
        )  # fmt: skip

    # The final dot is with primary, its outcome not written: retry later, nothing kept.
    assert (await applier.apply("primary", bounce("e1")))[0] is Applied.RETRY_LATER
    assert await store.provider_events("acme", "k") == []
    # Another provider's source cannot have the message: unmatched.
    assert (await applier.apply("standby", bounce("e2")))[0] is Applied.UNMATCHED
    # The owner's lease runs out before it writes the outcome: unknown, and still matched
    # through the provider its DATA went to, whatever became of the lease.
    later = NOW + s.lease + 5
    sub = Submission("acme", "k", "fp:k", "att:again", "inst-2", "<k@test>")
    verdict = ledger.decide(sending, sub, later, s)
    assert isinstance(verdict, ledger.Transition) and verdict.record.state is State.UNKNOWN
    assert await store.put(verdict.record, sending.version) is None
    assert (await applier.apply("primary", bounce("e3")))[0] is Applied.APPLIED
    assert [e.id for e in await store.provider_events("acme", "k")] == ["e3"]
    assert (await applier.apply("standby", bounce("e4")))[0] is Applied.UNMATCHED


async def test_an_event_is_applied_once_with_its_suppression(store: Store) -> None:
    before = await store.suppression_versions("acme")
    assert await store.apply_event(
        "acme", "inv-1", provider_event("e1", "Gone@Example.net"), "bounce 550 via mg"
    )
    assert not await store.apply_event("acme", "inv-1", provider_event("e1"), "bounce 550 via mg")
    assert await store.suppressed("acme", "gone@example.net") == "acme"
    assert await store.suppression_versions("acme") != before
    # Another event for the same address keeps the first reason; another source's id is its own.
    assert await store.apply_event("acme", "inv-1", provider_event("e1", source="sg"), "complaint via sg")
    assert [s.reason for s in await store.suppress_list("acme")] == ["bounce 550 via mg"]
    assert [e.id for e in await store.provider_events("acme", "inv-1")] == ["e1", "e1"]
    # History only: no suppression, and the zone's list does not change.
    version = await store.suppression_versions("acme")
    assert await store.apply_event("acme", "inv-1", provider_event("e2", "ok@example.net"), None)
    assert await store.suppressed("acme", "ok@example.net") is None
    assert await store.suppression_versions("acme") == version
    assert await store.provider_events("globex", "inv-1") == []
    assert await store.suppressed("globex", "gone@example.net") is None


async def test_concurrent_deliveries_of_one_event_apply_it_once(store: Store) -> None:
    results = await asyncio.gather(
        *(store.apply_event("acme", "inv-1", provider_event("e1"), "bounce 550 via mg") for _ in range(20))
    )
    assert sorted(results) == [False] * 19 + [True]
    assert len(await store.provider_events("acme", "inv-1")) == 1


async def test_purge_forgets_event_ids_after_retention_and_the_ids_of_purged_records(store: Store) -> None:
    rec = fresh("inv-1")
    assert await store.reserve(rec, None, None, False) == Reserved()
    assert await store.put(replace(settled(rec, NOW), upstream_id="Q1"), 1) is None
    assert await store.apply_event("acme", "inv-1", provider_event("e1"), None)
    await store.purge(NOW + RETENTION + 1, RETENTION)
    assert await store.get("acme", "inv-1") is None
    assert await store.find_records("upstream_id", "Q1") == []
    assert await store.find_records("message_id", "<inv-1@test>") == []
    assert await store.provider_events("acme", "inv-1") == []
    # The id is forgotten with it: the same event id is new again.
    assert await store.apply_event("acme", "inv-1", provider_event("e1", at=NOW + RETENTION + 2), None)


# --- the operator's desk (DESIGN.md §14) ------------------------------------------------------
async def _held_and_delivered(store: Store) -> None:
    for i in range(6):
        rec = fresh(f"k{i}", now=NOW + i)
        assert await store.reserve(rec, None, None, False) == Reserved()
        state = State.UNKNOWN if i % 3 == 0 else State.DELIVERED
        assert await store.put(settled(rec, NOW + 10 + i, state), 1) is None
    other = fresh("g1", zone="globex")
    assert await store.reserve(other, None, None, False) == Reserved()


async def test_records_are_listed_by_state_newest_first(store: Store) -> None:
    await _held_and_delivered(store)
    assert [r.key for r in await store.list_records("acme", "unknown", None, None, 10)] == ["k3", "k0"]
    assert [r.key for r in await store.list_records("acme", None, None, None, 3)] == ["k5", "k4", "k3"]
    assert [r.key for r in await store.list_records("acme", "delivered", NOW + 12, None, 10)] == [
        "k5",
        "k4",
        "k2",
    ]
    # Pages: before the oldest shown, exclusive.
    assert [r.key for r in await store.list_records("acme", None, None, NOW + 13, 2)] == ["k2", "k1"]
    assert [r.key for r in await store.list_records("globex", None, None, None, 10)] == ["g1"]
    assert await store.state_counts("acme") == {"unknown": 2, "delivered": 4}
    assert await store.state_counts("globex") == {"in_flight": 1}
    assert await store.state_counts("nobody") == {}


async def test_a_record_changing_state_leaves_its_old_list(store: Store) -> None:
    rec = fresh("k")
    assert await store.reserve(rec, None, None, False) == Reserved()
    held = settled(rec, NOW + 1, State.UNKNOWN)
    assert await store.put(held, 1) is None
    assert [r.key for r in await store.list_records("acme", "unknown", None, None, 10)] == ["k"]
    assert await store.put(replace(held, state=State.DELIVERED, version=3, updated_at=NOW + 2), 2) is None
    assert await store.list_records("acme", "unknown", None, None, 10) == []
    assert [r.key for r in await store.list_records("acme", "delivered", None, None, 10)] == ["k"]
    assert await store.state_counts("acme") == {"delivered": 1}
    await store.purge(NOW + RETENTION + 10, RETENTION)
    assert await store.list_records("acme", "delivered", None, None, 10) == []
    assert await store.state_counts("acme") == {}


async def test_a_record_is_found_by_its_smtpguard_id(store: Store) -> None:
    rec = fresh("k", attempt="01J0SGID")
    assert await store.reserve(rec, None, None, False) == Reserved()
    assert [r.key for r in await store.find_records("sg_id", "01J0SGID")] == ["k"]
    assert await store.find_records("sg_id", "nope") == []


async def test_zone_audit_is_kept_newest_first(store: Store) -> None:
    for i, action in enumerate(("pause", "resume", "suppress:add")):
        await store.audit_add("acme", ZoneAudit(NOW + i, "cli:ops@host", action, "x@y" if i == 2 else ""))
    await store.audit_add("globex", ZoneAudit(NOW, "console:alice", "pause"))
    assert [e.action for e in await store.audit_log("acme", NOW + 1)] == ["suppress:add", "resume"]
    assert (await store.audit_log("acme", 0))[0] == ZoneAudit(NOW + 2, "cli:ops@host", "suppress:add", "x@y")
    assert [e.actor for e in await store.audit_log("globex", 0)] == ["console:alice"]


async def test_redis_lists_records_written_before_the_state_sets(redis_server: RedisServer) -> None:
    plain = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await plain.flushall()
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        await _held_and_delivered(s)
        assert s._fold_task is not None
        await s._fold_task  # the upgrade started at open is done
        # As an earlier version left them: no per-state sets, no marker.
        for key in await plain.keys("sg:*:st:*"):
            await plain.delete(key)
        await plain.delete("sg:states-listed")
        for key in await plain.keys("sg:*:ev:*"):
            await plain.hdel(key, "sid")
        for key in await plain.keys("sg:*:ids"):
            for field in await plain.hkeys(key):
                if field.startswith("s:"):
                    await plain.hdel(key, field)
        k1 = await s.get("acme", "k1")
        assert k1 is not None and await s.find_records("sg_id", k1.sg_id) == []
        assert [r.key for r in await s.list_records("acme", "unknown", None, None, 10)] == ["k3", "k0"]
        await s._upgrade()
        assert await plain.exists("sg:states-listed")
        assert await s.state_counts("acme") == {"unknown": 2, "delivered": 4}
        assert [r.key for r in await s.list_records("acme", "unknown", None, None, 10)] == ["k3", "k0"]
        assert [r.key for r in await s.find_records("sg_id", k1.sg_id)] == ["k1"]
    finally:
        await s.close()
        await plain.aclose()


async def test_redis_state_upgrade_pages_through_equal_scores(redis_server: RedisServer) -> None:
    """More records with one updated_at than a page holds: none is skipped or left out."""
    plain = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await plain.flushall()
    s = RedisStore(redis_server.url)
    await s.open()
    try:
        assert s._fold_task is not None
        await s._fold_task
        recs = [replace(fresh(f"t{i:04}", now=NOW), updated_at=NOW) for i in range(1200)]
        for chunk in range(0, len(recs), 200):
            await asyncio.gather(*(s.reserve(r, None, None, False) for r in recs[chunk : chunk + 200]))
        for key in await plain.keys("sg:*:st:*"):
            await plain.delete(key)
        await plain.delete("sg:states-listed")
        await s._upgrade()
        assert await s.state_counts("acme") == {"in_flight": 1200}
    finally:
        await s.close()
        await plain.aclose()


async def test_a_nonce_is_remembered_with_its_digest(store: Store) -> None:
    until = store.now() + 300
    assert await store.remember_nonce("mg:tok1", "d1", until)
    assert await store.remember_nonce("mg:tok1", "d1", until)  # the same request again
    assert not await store.remember_nonce("mg:tok1", "d2", until)  # another body
    assert await store.remember_nonce("mg:tok2", "d2", until)
    results = await asyncio.gather(*(store.remember_nonce("mg:race", f"d{i % 2}", until) for i in range(20)))
    assert results.count(True) in range(1, 20) and len(set(results)) == 2


async def test_sqlite_counts_the_records_of_a_file_that_predates_the_counts(tmp_path: Path) -> None:
    import sqlite3

    url = f"sqlite:///{tmp_path / 'state.db'}"
    s = store_from_url(url)
    await s.open()
    await _held_and_delivered(s)
    await s.close()
    conn = sqlite3.connect(tmp_path / "state.db")
    for trigger in ("events_count_insert", "events_count_update", "events_count_delete"):
        conn.execute(f"DROP TRIGGER {trigger}")
    conn.execute("DROP TABLE state_counts")
    conn.commit()
    conn.close()
    s = store_from_url(url)
    await s.open()
    try:
        assert await s.state_counts("acme") == {"unknown": 2, "delivered": 4}
        rec = await s.get("acme", "k0")
        assert rec is not None
        assert await s.put(replace(rec, state=State.DELIVERED, version=rec.version + 1), rec.version) is None
        assert await s.state_counts("acme") == {"unknown": 1, "delivered": 5}
    finally:
        await s.close()


async def test_queue_depths_count_entries_per_zone_and_lane(store: Store) -> None:
    assert await store.queue_depths() == {}
    await put_queued(
        store,
        queued("q1"),
        queued("q2"),
        queued("q3", lane="otp"),
        queued("g1", zone="globex", lane="bulk"),
    )
    assert await store.queue_depths() == {
        ("acme", "transactional"): 2,
        ("acme", "otp"): 1,
        ("globex", "bulk"): 1,
    }
    # A claimed entry is still on the queue; one taken off it is not counted, nor its empty lane.
    [claimed] = await store.claim(NOW, [("otp", 5)], LEASE)
    assert (await store.queue_depths())[("acme", "otp")] == 1
    assert await store.requeue(settled(claimed.record, NOW + 1), 1, None) is None
    depths = await store.queue_depths()
    assert depths == {("acme", "transactional"): 2, ("globex", "bulk"): 1}
    assert depths == dict(Counter((e.zone, e.lane) for e in await store.queue_entries(None)))


# --- provider throttling (DESIGN.md §16) -----------------------------------------------------
def _another(store: Store) -> Store:
    """A second store object on the same backend: another instance of the fleet."""
    url = getattr(store, "url", None) or f"sqlite:///{store.path}"  # type: ignore[attr-defined]
    return store_from_url(url)


async def test_rate_slots_are_spaced_by_the_interval_and_refused_past_max_wait(store: Store) -> None:
    first = await store.rate_slot("primary", 0.1, 0.25, NOW)
    assert first.granted and first.wait == 0
    waits = [await store.rate_slot("primary", 0.1, 0.25, NOW) for _ in range(3)]
    assert [s.granted for s in waits] == [True, True, False]
    assert [round(s.wait, 6) for s in waits[:2]] == [0.1, 0.2]
    # Refused: nothing reserved, and it says how long until a slot is within max_wait.
    assert round(waits[2].wait, 6) == 0.05
    again = await store.rate_slot("primary", 0.1, 0.25, NOW)
    assert not again.granted and round(again.wait, 6) == 0.05
    # Another provider has slots of its own; time passing frees them.
    assert (await store.rate_slot("standby", 0.1, 0.25, NOW)).wait == 0
    later = await store.rate_slot("primary", 0.1, 0.25, NOW + 10)
    assert later.granted and later.wait == 0


async def test_rate_slots_after_max_rate_was_raised_resume_within_one_new_interval(store: Store) -> None:
    """1/h, then (a reload) 10/s: the hour-ahead arrival time is pulled back and stored, so
    slots resume 0.1 s later instead of an hour later; the new spacing holds after that."""
    assert (await store.rate_slot("primary", 3600.0, 0.25, NOW)).granted
    refused = await store.rate_slot("primary", 0.1, 0.25, NOW)
    assert not refused.granted and round(refused.wait, 6) == 0.1
    granted = await store.rate_slot("primary", 0.1, 0.25, NOW + 0.1)
    assert granted.granted and round(granted.wait, 6) == 0.25
    assert not (await store.rate_slot("primary", 0.1, 0.25, NOW + 0.1)).granted


async def test_rate_slots_are_one_sequence_for_every_instance(store: Store) -> None:
    other = _another(store)
    await other.open()
    try:
        slots = await asyncio.gather(*(s.rate_slot("primary", 0.1, 10.0, NOW) for s in [store, other] * 10))
    finally:
        await other.close()
    waits = sorted(round(s.wait, 3) for s in slots if s.granted)
    # 20 callers on two instances at one instant: 20 distinct slots, 0.1 s apart.
    assert waits == [round(i * 0.1, 3) for i in range(20)]


async def test_a_throttle_is_shared_never_shortened_and_ends(store: Store) -> None:
    assert await store.throttled(NOW) == {}
    await store.set_throttled("primary", NOW + 60)
    await store.set_throttled("primary", NOW + 30)  # an earlier end does not shorten it
    await store.set_throttled("primary", NOW + 60)  # idempotent
    other = _another(store)
    await other.open()
    try:
        assert await other.throttled(NOW) == {"primary": NOW + 60}
        await other.set_throttled("primary", NOW + 90)
    finally:
        await other.close()
    assert await store.throttled(NOW + 61) == {"primary": NOW + 90}
    assert await store.throttled(NOW + 90) == {}


async def test_connection_slots_never_exceed_the_limit_across_instances(store: Store) -> None:
    other = _another(store)
    await other.open()
    try:
        got = await asyncio.gather(
            *(
                s.hold_connection("primary", f"{n}:{i}", 3, NOW + 15, NOW)
                for i in range(10)
                for n, s in (("a", store), ("b", other))
            )
        )
        assert sum(got) == 3
        holders = [f"{n}:{i}" for i in range(10) for n in ("a", "b")]
        winners = [h for h, ok in zip(holders, got, strict=True) if ok]
        # A holder renews its own slot; a newcomer still finds none.
        assert await other.hold_connection("primary", winners[0], 3, NOW + 30, NOW + 10)
        assert not await store.hold_connection("primary", "c:1", 3, NOW + 25, NOW + 10)
        # A dropped slot is free at once (and dropping twice is harmless).
        await store.drop_connection("primary", winners[1])
        await store.drop_connection("primary", winners[1])
        assert await store.hold_connection("primary", "c:1", 3, NOW + 25, NOW + 10)
        assert not await other.hold_connection("primary", "c:2", 3, NOW + 25, NOW + 10)
        # A crashed holder's lease ends: its slot (winners[2], until NOW + 15) comes back.
        assert await other.hold_connection("primary", "c:2", 3, NOW + 31, NOW + 16)
        # The limit is per provider.
        assert await store.hold_connection("standby", "a:0", 1, NOW + 15, NOW)
    finally:
        await other.close()
