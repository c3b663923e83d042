"""Reconciliation (DESIGN.md §19): a bounce no webhook brought is read from the provider's
log API (a local fake that follows Mailgun's and Postmark's documented shapes) and applied
through the webhook's own path, once: polling again, or the same event arriving by webhook
afterwards, changes nothing. The cursor is in the store and survives a restart; a period
whose API call fails is read again. Real client, real guard on a real SQLite file or
redis-server, recording upstream; the clock is injected and polls are called, not waited for."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard.events.reconcile import OVERLAP, Polled, cursor_name
from smtpguard.server import Server
from smtpguard.verdicts.mailgun import MAX_PAGES, PAGE
from tests.events.test_events import RCPT, events_config, events_port, sent, suppressed
from tests.support import FakeClock, Upstream, message, running_guard, send
from tests.support import events as ev
from tests.support.provider_api_fakes import FakeMailgun, FakePostmark, FakeSendgrid
from tests.support.utf8 import store_overrides

API_KEY = "key-3ax6xnjp29jd6fds4gc373sgvjxteol0"
PERIOD = 900.0


@pytest.fixture(autouse=True)
def api_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILGUN_API_KEY", API_KEY)
    monkeypatch.setenv("POSTMARK_SERVER_TOKEN", API_KEY)
    monkeypatch.setenv("SENDGRID_API_KEY", API_KEY)


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=10)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def mailgun(clock: FakeClock) -> AsyncIterator[FakeMailgun]:
    fake = FakeMailgun(API_KEY, "mg.acme.example", clock)
    await fake.start()
    yield fake
    await fake.stop()


def reconcile_config(
    tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any], api: dict[str, Any], source: str
) -> dict[str, Any]:
    cfg = events_config(tmp, upstream, keys, store, only=source)
    cfg["providers"][0]["api"] = api
    cfg["reconcile"] = {"events": f"{PERIOD:.0f}s"}
    return cfg


@pytest.fixture
def cfg(
    tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any], mailgun: FakeMailgun
) -> dict[str, Any]:
    """A guard reading Mailgun's webhooks and reconciling with its log API (the fake)."""
    api = {
        "kind": "mailgun",
        "key_env": "MAILGUN_API_KEY",
        "domain": mailgun.domain,
        "base_url": mailgun.base_url,
    }
    return reconcile_config(tmp, upstream, keys, store, api, "mailgun")


async def poll(server: Server) -> Polled:
    assert server.reconciler is not None
    (polled,) = await server.reconciler.poll()
    return polled


async def stored_events(server: Server, key: str) -> list[tuple[str, str, str | None, str]]:
    assert server.store is not None
    return [(e.source, e.type, e.recipient, e.id) for e in await server.store.provider_events("acme", key)]


async def test_a_bounce_no_webhook_brought_is_applied_once_whichever_way_it_comes_again(
    cfg: dict[str, Any], upstream: Upstream, keys: ev.Keys, clock: FakeClock, mailgun: FakeMailgun
) -> None:
    async with running_guard(cfg, clock=clock) as guard:
        message_id, _ = await sent(guard, upstream, "invoice:1")
        bounce = mailgun.add(
            "failed", clock.t - 60, message_id=message_id, recipient=RCPT, severity="permanent"
        )

        first = await poll(guard)
        assert (first.outcomes, first.advanced) == ({"applied": 1}, True), first
        assert first.since == clock.t - PERIOD - OVERLAP  # never read before: the last period
        assert await suppressed(guard, "acme") == {RCPT: "bounce 550 via mailgun"}
        assert await stored_events(guard, "invoice:1") == [("mailgun", "bounce", RCPT, bounce["id"])]

        # Read again (the overlap): a duplicate.
        clock.t += 60
        again = await poll(guard)
        assert (again.outcomes, again.advanced) == ({"duplicate": 1}, True), again

        # The same event by webhook afterwards: 200, a duplicate, nothing changed.
        data = ev.mailgun_event("failed", RCPT, message_id, severity="permanent")
        data["id"] = bounce["id"]
        status, doc = await ev.post(events_port(guard), "mailgun", ev.mailgun(keys, data, at=clock.t))
        assert (status, doc.get("duplicate"), doc.get("applied")) == (200, 1, 0), doc
        assert await suppressed(guard, "acme") == {RCPT: "bounce 550 via mailgun"}
        assert len(await stored_events(guard, "invoice:1")) == 1

        # The bounced address is refused at RCPT; the upstream still has one copy.
        reply = await send(guard.ports[0], message("invoice:2", to=RCPT), recipients=[RCPT])
        assert reply.code == 550 and "5.1.1" in reply.text, reply
    assert len(upstream.received) == 1


async def test_the_cursor_survives_a_restart_and_a_failed_period_is_read_again(
    cfg: dict[str, Any], upstream: Upstream, keys: ev.Keys, clock: FakeClock, mailgun: FakeMailgun
) -> None:
    async with running_guard(cfg, clock=clock) as guard:
        message_id, _ = await sent(guard, upstream, "invoice:1")
        first = await poll(guard)
        assert (first.outcomes, first.advanced) == ({}, True), first
        read_up_to = first.until

    clock.t += PERIOD
    # Logged while no instance ran, older than the restart by more than a period.
    mailgun.add("complained", read_up_to + 5, message_id=message_id, recipient=RCPT)
    async with running_guard(cfg, clock=clock) as guard:
        assert guard.store is not None
        assert await guard.store.reconcile_cursor(cursor_name("primary")) == read_up_to
        # The API refuses the poll (a 401 is never retried): nothing applied, the cursor stays.
        mailgun.fail(401)
        failed = await poll(guard)
        assert (failed.advanced, failed.outcomes) == (False, {}) and failed.error, failed
        assert await guard.store.reconcile_cursor(cursor_name("primary")) == read_up_to

        clock.t += PERIOD
        later = await poll(guard)
        assert later.since == read_up_to - OVERLAP
        assert (later.outcomes, later.advanced) == ({"applied": 1}, True), later
        assert await suppressed(guard, "acme") == {RCPT: "complaint via mailgun"}
        assert await guard.store.reconcile_cursor(cursor_name("primary")) == clock.t
    assert len(upstream.received) == 1


async def test_a_postmark_bounce_reconciled_then_by_webhook_is_one_event(
    tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any], clock: FakeClock
) -> None:
    postmark = await FakePostmark(API_KEY, clock).start()
    try:
        api = {"kind": "postmark", "token_env": "POSTMARK_SERVER_TOKEN", "base_url": postmark.base_url}
        cfg = reconcile_config(tmp, upstream, keys, store, api, "postmark")
        async with running_guard(cfg, clock=clock) as guard:
            _, queue_id = await sent(guard, upstream, "invoice:1")
            assert guard.store is not None
            record = await guard.store.get("acme", "invoice:1")
            assert record is not None and record.upstream_id
            bounce = postmark.add_bounce(clock.t - 60, email=RCPT, message_id=record.upstream_id)
            polled = await poll(guard)
            assert (polled.outcomes, polled.advanced) == ({"applied": 1}, True), polled
            assert await suppressed(guard, "acme") == {RCPT: "bounce HardBounce via postmark"}

            webhook = ev.postmark_bounce(RCPT, record.upstream_id)
            webhook["ID"] = bounce["ID"]
            status, doc = await ev.post(events_port(guard), "postmark", ev.postmark(keys, webhook))
            assert (status, doc.get("duplicate"), doc.get("applied")) == (200, 1, 0), doc
            assert len(await stored_events(guard, "invoice:1")) == 1
            assert queue_id
    finally:
        await postmark.stop()
    assert len(upstream.received) == 1


async def test_sendgrid_suppression_entries_name_no_record_and_suppress_nothing(
    tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any], clock: FakeClock
) -> None:
    """SendGrid's suppression lists give the address and a time, no message: reconciliation
    cannot tie the entry to a record, so it counts it unmatched (docs/verdicts.md) and keeps
    reading; the SendGrid webhook, which names the message, stays the way its bounces land."""
    sendgrid = await FakeSendgrid(API_KEY, clock).start()
    try:
        api = {"kind": "sendgrid", "key_env": "SENDGRID_API_KEY", "base_url": sendgrid.base_url}
        cfg = reconcile_config(tmp, upstream, keys, store, api, "sendgrid")
        async with running_guard(cfg, clock=clock) as guard:
            await sent(guard, upstream, "invoice:1")
            sendgrid.add_suppression("bounces", email=RCPT, created=int(clock.t - 60), status="5.1.1")
            polled = await poll(guard)
            assert (polled.outcomes, polled.advanced) == ({"unmatched": 1}, True), polled
            assert await suppressed(guard, "acme") == {}
            assert await stored_events(guard, "invoice:1") == []
    finally:
        await sendgrid.stop()
    assert len(upstream.received) == 1


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_period_longer_than_the_pages_read_is_finished_by_the_next_polls(
    cfg: dict[str, Any], upstream: Upstream, clock: FakeClock, mailgun: FakeMailgun
) -> None:
    """A busy period: more bounces than one poll's pages (10 of 300) before ours. The cursor
    must not pass what was not read, or the bounce is never applied."""
    async with running_guard(cfg, clock=clock) as guard:
        message_id, _ = await sent(guard, upstream, "invoice:busy")
        noise = MAX_PAGES * PAGE
        for n in range(noise):  # other senders' bounces, no record of ours, before it
            at = clock.t - PERIOD + 10 + n * (PERIOD - OVERLAP - 120) / noise
            mailgun.add("failed", at, message_id=f"<n{n}@else.example>", recipient=f"n{n}@else.example")
        mailgun.add("failed", clock.t - OVERLAP - 100, message_id=message_id, recipient=RCPT)
        for _ in range(4):
            if RCPT in await suppressed(guard, "acme"):
                break
            clock.t += 60
            await poll(guard)
        assert await suppressed(guard, "acme") == {RCPT: "bounce 550 via mailgun"}
