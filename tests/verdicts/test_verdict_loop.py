"""The verdict loop in `serve` (DESIGN.md §19), row by row of the table: a real client, a
real listener, a real upstream sink that takes the final dot and drops the connection
before its reply (the lost 250), a real store, and a local fake of the provider's log API
over real HTTP. The loop's clock is injected (the guard's and the fake's), so `after`,
`every` and `absent_after` pass without sleeping; each round is the loop's own step.
Every test counts what the upstream received."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from smtpguard import desk
from smtpguard.policy.ledger import Record, State
from smtpguard.policy.verdicts import VerdictKind
from tests.support import Behaviour, FakeClock, Upstream, message, running_guard, send
from tests.support.eventually import eventually
from tests.support.provider_api_fakes import FakeMailgun
from tests.support.verdicts import API_KEY, MAILGUN_DOMAIN, MINUTE, QUEUED, Harness, make_fake, serving
from tests.support.verdicts import verdict_harness as harness

__all__ = ["MINUTE", "Harness", "harness", "make_fake"]
"""What verdict tests written before tests/support/verdicts.py held them import from here."""

SQLITE_ONLY = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
"""Rows whose store part is the same compare-and-swap the other rows run on both stores."""


def delivered(rec: Record) -> bool:
    return rec.state is State.DELIVERED


def audit_of(rec: Record) -> list[tuple[str, str, str]]:
    return [(a.actor, a.action, a.note) for a in rec.audit if a.actor.startswith("verdict:")]


@pytest.mark.parametrize("kind", ["mailgun", "postmark", "sendgrid"])
async def test_accepted_in_the_log_delivers_and_the_retry_is_a_duplicate(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    async with harness(tmp, upstream, store_url, monkeypatch, kind) as h:
        await h.lost_and_logged("a1")
        assert await h.after(MINUTE) == []  # before `after`: the log is not asked
        assert h.fake.requests == []
        assert await h.after(MINUTE + 1) == [VerdictKind.ACCEPTED]
        done = await h.record("a1", State.DELIVERED)
        assert audit_of(done)[0][:2] == ("verdict:primary", "verdict:accepted")
        assert audit_of(done)[0][2].startswith("verdict accepted via api primary")
        again = await send(h.guard.ports[0], message("a1"))
        assert again.code == 250 and "duplicate" in again.text
        assert await h.after(10 * MINUTE) == []  # settled: never asked again
    assert upstream.event_keys() == ["a1"]


@SQLITE_ONLY
async def test_refused_in_the_log_fails_with_its_reason(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        await h.lost_and_logged("r1", "rejected", "Sandbox subdomains are for test only")
        assert await h.after(2 * MINUTE + 1) == [VerdictKind.REFUSED]
        failed = await h.record("r1", State.FAILED)
        assert "Sandbox subdomains" in audit_of(failed)[0][2]
        again = await send(h.guard.ports[0], message("r1"))
        assert again.code == 550 and "Sandbox subdomains" in again.text
    assert upstream.event_keys() == ["r1"]


async def test_not_accepted_needs_absent_after_and_the_proof_then_the_retry_sends_once(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        rec = await h.lose_reply("n1")
        at = rec.attempts[-1].at
        # The provider never took it (its log will never show it). Another message's
        # acceptance after it proves the log has ingested past the attempt.
        h.other_acceptance(at + 30)
        assert await h.after(2 * MINUTE + 1) == [VerdictKind.NONE_YET]  # before absent_after
        for _ in range(5):
            assert await h.after(5 * MINUTE) == [VerdictKind.NONE_YET]
        await h.record("n1", State.UNKNOWN)
        assert await h.after(5 * MINUTE) == [VerdictKind.NOT_ACCEPTED]  # 32 min after
        deferred = await h.record("n1", State.DEFERRED)
        assert audit_of(deferred)[0][:2] == ("verdict:primary", "verdict:not_accepted")
        sent = await send(h.guard.ports[0], message("n1"))
        assert sent.code == 250 and "duplicate" not in sent.text
        dup = await send(h.guard.ports[0], message("n1"))
        assert dup.code == 250 and "duplicate" in dup.text
    # the copy the provider never took, and the one resend it accepted
    assert upstream.event_keys() == ["n1", "n1"]


@SQLITE_ONLY
async def test_nothing_in_the_log_without_the_proof_stays_unknown(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        await h.lose_reply("p1")
        assert await h.after(2 * MINUTE + 1) == [VerdictKind.NONE_YET]
        assert await h.after(40 * MINUTE) == [VerdictKind.NONE_YET]  # past absent_after, no proof
        still = await h.record("p1", State.UNKNOWN)
        assert audit_of(still) == []
        held = await send(h.guard.ports[0], message("p1"))
        assert held.code == 451 and "unknown" in held.text
    assert upstream.event_keys() == ["p1"]


@SQLITE_ONLY
async def test_api_down_stays_unknown_counts_errors_then_settles_when_it_answers(
    tmp: Path,
    upstream: Upstream,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        await h.lost_and_logged("d1")
        # Every request of the look fails (the client retries a 5xx a bounded number of times).
        h.fake.fail(500, times=4)
        # the client's backoff between its retries is real time: 0.5 + 1 + 2 s
        assert await h.after(2 * MINUTE + 1) == [VerdictKind.NONE_YET]
        await h.record("d1", State.UNKNOWN)
        said = [r for r in caplog.records if "could not be read" in r.getMessage()]
        assert len(said) == 1 and said[0].records == 1  # type: ignore[attr-defined]
        assert all(API_KEY not in str(r.__dict__) for r in caplog.records)
        metrics = h.guard.metrics.render().decode()
        assert 'smtpguard_verdict_api_errors_total{kind="server",provider="primary"} 4.0' in metrics
        assert 'smtpguard_verdict_api_errors_total{kind="unavailable",provider="primary"} 1.0' in metrics
        assert await h.after(5 * MINUTE) == [VerdictKind.ACCEPTED]
        await h.record("d1", State.DELIVERED)
        metrics = h.guard.metrics.render().decode()
        assert 'smtpguard_verdicts_total{provider="primary",verdict="accepted"} 1.0' in metrics
        assert 'smtpguard_verdicts_total{provider="primary",verdict="none_yet"} 1.0' in metrics
    assert upstream.event_keys() == ["d1"]


@SQLITE_ONLY
async def test_429_is_honoured_within_the_look(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        await h.lost_and_logged("t1")
        h.fake.fail(429, times=1, retry_after="1")
        assert await h.after(2 * MINUTE + 1) == [VerdictKind.ACCEPTED]
        first, second = h.fake.requests[0], h.fake.requests[1]
        # the second request waited for Retry-After (monotonic times of arrival)
        assert second.at - first.at >= 1.0
        await h.record("t1", State.DELIVERED)
        metrics = h.guard.metrics.render().decode()
        assert 'smtpguard_verdict_api_errors_total{kind="rate_limited",provider="primary"} 1.0' in metrics
    assert upstream.event_keys() == ["t1"]


@pytest.mark.parametrize("decision", ["delivered", "retry"])
async def test_an_operator_decision_first_is_never_touched(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, decision: str
) -> None:
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        await h.lost_and_logged("o1")
        assert h.guard.store is not None
        decided = await desk.decide(h.guard.store, "acme", "o1", decision, "cli:ops@host", None)
        assert await h.after(2 * MINUTE + 1) == []  # not unknown any more: not even asked
        after = await h.record("o1")
        assert after.version == decided.version and audit_of(after) == []
        reply = await send(h.guard.ports[0], message("o1"))
        if decision == "delivered":
            assert reply.code == 250 and "duplicate" in reply.text
    # the operator's retry sends, as they decided; a verdict added nothing
    assert upstream.event_keys() == ["o1"] * (1 if decision == "delivered" else 2)


async def test_a_decision_between_the_look_and_the_write_wins(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator resolves while the loop's request is in the air: the compare-and-swap
    finds the record changed and the verdict leaves it alone."""
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        await h.lost_and_logged("c1")
        store = h.guard.store
        assert store is not None
        client = h.loop.clients["primary"]
        asked = client.entries

        async def operator_first(attempt):  # type: ignore[no-untyped-def]
            found = await asked(attempt)
            await desk.decide(store, "acme", "c1", "retry", "cli:ops@host", None)
            return found

        monkeypatch.setattr(client, "entries", operator_first)
        assert await h.after(2 * MINUTE + 1) == [VerdictKind.ACCEPTED]
        after = await h.record("c1", State.DEFERRED)
        assert audit_of(after) == []
        assert [a.actor for a in after.audit][-1] == "cli:ops@host"
    assert upstream.event_keys() == ["c1"]


async def test_a_queued_event_follows_its_record(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Store-and-forward: a not-accepted verdict re-queues the entry and the worker sends it
    once; an accepted one takes it off the queue."""
    async with harness(tmp, upstream, store_url, monkeypatch, **QUEUED) as h:
        upstream.handler.script = [Behaviour(drop_after_dot=True), Behaviour(drop_after_dot=True)]
        for key in ("q1", "q2"):
            assert (await send(h.guard.ports[0], message(key))).code == 250
        store = h.guard.store
        assert store is not None
        await eventually(
            lambda: store.list_records("acme", "unknown", None, None, 10),
            lambda recs: len(recs) == 2,
            timeout=15,
            interval=0.05,
        )
        q1 = next(r for r in upstream.received if r.header("X-Event-Key") == "q1")
        at = (await h.record("q1")).attempts[-1].at
        h.log(q1, at + 1)
        h.other_acceptance(at + 30)
        assert sorted(await h.after(2 * MINUTE + 1)) == sorted([VerdictKind.ACCEPTED, VerdictKind.NONE_YET])
        await h.record("q1", State.DELIVERED)
        assert await h.after(30 * MINUTE) == [VerdictKind.NOT_ACCEPTED]
        h.clock.t += 2 * MINUTE  # past min_retry_interval: the worker's entry is due
        await eventually(
            lambda: h.record("q2"), lambda r: r.state is State.DELIVERED, timeout=15, interval=0.05
        )
        assert not [e for e in await store.queue_entries("acme") if e.key == "q1"]
    assert sorted(k for k in upstream.event_keys() if k) == ["q1", "q2", "q2"]


@SQLITE_ONLY
async def test_serve_runs_the_loop_on_its_own_and_logs_no_not_applied_warning(
    tmp: Path,
    upstream: Upstream,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The background task, not a test's call, settles the record."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr("smtpguard.verdicts.loop.TICK", 0.05)
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        await h.lost_and_logged("b1")
        h.clock.t += 2 * MINUTE + 1
        await eventually(
            lambda: h.record("b1"), lambda r: r.state is State.DELIVERED, timeout=10, interval=0.05
        )
    assert not any("not yet applied" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage() == "verdict loop started" for r in caplog.records)
    assert all(API_KEY not in r.getMessage() and API_KEY not in str(r.__dict__) for r in caplog.records)
    assert upstream.event_keys() == ["b1"]


@SQLITE_ONLY
async def test_a_reload_that_moves_the_api_is_followed(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGHUP with another `base_url` (an EU region, say): the next look asks the new one."""
    clock = FakeClock()
    async with (
        serving(FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock)) as new,
        harness(tmp, upstream, store_url, monkeypatch, clock=clock) as h,
    ):
        old, h.fake = h.fake, new
        await h.lost_and_logged("m1")  # only the new API's log has it
        h.cfg["providers"][0]["api"]["base_url"] = new.base_url
        assert await h.reload()
        assert await h.after(2 * MINUTE + 1) == [VerdictKind.ACCEPTED]
        await h.record("m1", State.DELIVERED)
    assert old.requests == [] and new.requests
    assert upstream.event_keys() == ["m1"]


class TickingClock(FakeClock):
    """Moves a microsecond at every reading, as a real clock moves between two instances'
    writes. (On a clock that stands still both would write the same bytes, which the store
    takes as one write landing twice: one record, two audit lines.)"""

    def __call__(self) -> float:
        self.t += 1e-6
        return self.t


async def test_two_instances_looking_at_once_settle_once(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every host runs the loop; both ask about the same records in the same instant, and
    the store's compare-and-swap lets one verdict write per record."""
    breaker = {"failure_threshold": 20}  # six lost replies in a row are the point here
    async with (
        harness(
            tmp, upstream, store_url, monkeypatch, clock=TickingClock(), instance="a", breaker=breaker
        ) as h,
        running_guard({**h.cfg, "instance": "b"}, clock=h.clock) as b,
    ):
        a, clock = h.guard, h.clock
        keys = [f"x{i}" for i in range(6)]
        for i, key in enumerate(keys):
            if i % 2:
                await h.lost_and_logged(key)
            else:
                await h.lose_reply(key)
        h.other_acceptance(clock.t + 1)
        assert a.verdicts is not None and b.verdicts is not None
        clock.t += 31 * MINUTE
        await asyncio.gather(a.verdicts.round(), b.verdicts.round())
        for i, key in enumerate(keys):
            rec = await h.record(key, State.DEFERRED if i % 2 == 0 else State.DELIVERED)
            assert len(audit_of(rec)) == 1, audit_of(rec)
        assert a.store is not None
        zone_audit = [e for e in await a.store.audit_log("acme", 0) if e.actor.startswith("verdict:")]
        assert len(zone_audit) == len(keys)
        clock.t += 2 * MINUTE
        for key in keys:
            reply = await send(b.ports[0], message(key))
            assert reply.code == 250
    # the not-accepted ones sent once more, the accepted ones never again
    assert sorted(k for k in upstream.event_keys() if k) == sorted(
        keys + [k for i, k in enumerate(keys) if i % 2 == 0]
    )
