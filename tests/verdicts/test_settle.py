"""settle(): the one way a verdict changes a record (DESIGN.md §19), through the store's
compare-and-swap, on a record a real client left `unknown` through a real listener and a
real upstream that took the dot and dropped the connection before its reply."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard import desk
from smtpguard.policy.ledger import Record, State
from smtpguard.policy.verdicts import Verdict, VerdictKind
from smtpguard.server import Server
from smtpguard.verdicts.settle import settle
from tests.support import Behaviour, FakeClock, Upstream, base_config, message, running_guard, send
from tests.support.utf8 import store_overrides


@pytest.fixture(params=["sqlite", "redis", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp: Path) -> Iterator[str]:
    """settle() is the store's compare-and-swap: here on PostgreSQL too (cheap: no loop)."""
    if request.param == "postgres":
        from tests.store.test_postgres import database

        yield database(request.getfixturevalue("postgres_server"))
        return
    for overrides in store_overrides(request, tmp, redis_db=12):
        yield overrides["store__url"]


def config(tmp: Path, upstream: Upstream, store_url: str) -> dict[str, Any]:
    cfg = base_config(tmp, upstream.port)
    cfg["store"] = {"url": store_url, **({"unsafe": True} if store_url.startswith("redis") else {})}
    return cfg


async def unknown(guard: Server, upstream: Upstream, key: str) -> Record:
    upstream.handler.script = [Behaviour(drop_after_dot=True)]
    reply = await send(guard.ports[0], message(key))
    assert reply.code == 451 and "unknown" in reply.text
    assert guard.store is not None
    rec = await guard.store.get("acme", key)
    assert rec is not None and rec.state is State.UNKNOWN
    return rec


async def test_accepted_delivers_with_the_logs_id_and_the_retry_is_a_duplicate(
    tmp: Path, upstream: Upstream, store_url: str
) -> None:
    async with running_guard(config(tmp, upstream, store_url)) as guard:
        rec = await unknown(guard, upstream, "s1")
        assert guard.store is not None
        new = await settle(
            guard.store, "acme", "s1", Verdict(VerdictKind.ACCEPTED, "mg-123"), "api", "primary",
            attempt_id=rec.sg_id,
        )  # fmt: skip
        assert new is not None and new.state is State.DELIVERED and new.upstream_id == "mg-123"
        last = new.audit[-1]
        assert (last.actor, last.action, last.from_state, last.to_state) == (
            "verdict:primary", "verdict:accepted", "unknown", "delivered",
        )  # fmt: skip
        assert last.note.startswith("verdict accepted via api primary")
        zone_audit = await guard.store.audit_log("acme", 0)
        noted = [(a.actor, a.action, a.key) for a in zone_audit]
        assert noted == [("verdict:primary", "verdict:accepted", "s1")]
        again = await send(guard.ports[0], message("s1"))
        assert again.code == 250 and "duplicate" in again.text and "mg-123" in again.text
    assert upstream.event_keys() == ["s1"]


async def test_refused_fails_with_the_logs_reason(tmp: Path, upstream: Upstream, store_url: str) -> None:
    async with running_guard(config(tmp, upstream, store_url)) as guard:
        await unknown(guard, upstream, "s2")
        assert guard.store is not None
        verdict = Verdict(VerdictKind.REFUSED, None, "Sandbox subdomains are for test purposes only")
        new = await settle(guard.store, "acme", "s2", verdict, "api", "primary")
        assert new is not None and new.state is State.FAILED
        again = await send(guard.ports[0], message("s2"))
        assert again.code == 550 and "Sandbox subdomains" in again.text
    assert upstream.event_keys() == ["s2"]


async def test_not_accepted_defers_and_the_next_retry_sends_once(
    tmp: Path, upstream: Upstream, store_url: str
) -> None:
    clock = FakeClock()
    async with running_guard(config(tmp, upstream, store_url), clock=clock) as guard:
        rec = await unknown(guard, upstream, "s3")
        assert guard.store is not None
        new = await settle(
            guard.store, "acme", "s3", Verdict(VerdictKind.NOT_ACCEPTED), "api", "primary", clock=clock
        )
        assert new is not None and new.state is State.DEFERRED
        # the usual min_retry_interval (60s in base_config) after the unknown attempt
        assert new.next_attempt_at == rec.attempts[-1].at + 60
        too_soon = await send(guard.ports[0], message("s3"))
        assert too_soon.code == 451 and "retry after" in too_soon.text
        clock.t += 61
        sent = await send(guard.ports[0], message("s3"))
        assert sent.code == 250 and "duplicate" not in sent.text
        dup = await send(guard.ports[0], message("s3"))
        assert dup.code == 250 and "duplicate" in dup.text
    # the dropped copy, which the log says the provider never accepted, and the one resend
    assert upstream.event_keys() == ["s3", "s3"]


async def test_an_operator_decision_first_is_left_alone(
    tmp: Path, upstream: Upstream, store_url: str
) -> None:
    async with running_guard(config(tmp, upstream, store_url)) as guard:
        await unknown(guard, upstream, "s4")
        assert guard.store is not None
        decided = await desk.decide(guard.store, "acme", "s4", "delivered", "cli:ops@host", None)
        for kind in (VerdictKind.ACCEPTED, VerdictKind.REFUSED, VerdictKind.NOT_ACCEPTED):
            assert await settle(guard.store, "acme", "s4", Verdict(kind), "api", "primary") is None
        after = await guard.store.get("acme", "s4")
        assert after is not None and after.version == decided.version and after.state is State.DELIVERED
        assert not [a for a in after.audit if a.actor.startswith("verdict:")]
        gone = await settle(guard.store, "acme", "nope", Verdict(VerdictKind.ACCEPTED), "api", "primary")
        assert gone is None
    assert upstream.event_keys() == ["s4"]


async def test_a_verdict_about_an_attempt_since_retried_is_left_alone(
    tmp: Path, upstream: Upstream, store_url: str
) -> None:
    async with running_guard(config(tmp, upstream, store_url)) as guard:
        rec = await unknown(guard, upstream, "s5")
        assert guard.store is not None
        await desk.decide(guard.store, "acme", "s5", "retry", "cli:ops@host", None)
        await unknown(guard, upstream, "s5")
        old = Verdict(VerdictKind.NOT_ACCEPTED)
        assert await settle(guard.store, "acme", "s5", old, "api", "primary", attempt_id=rec.sg_id) is None
        still = await guard.store.get("acme", "s5")
        assert still is not None and still.state is State.UNKNOWN
    assert upstream.event_keys() == ["s5", "s5"]
