"""The console's search box and who settled what (DESIGN.md §14, §19), over HTTP: a record is
found by its event key, its sg id, its Message-ID and its upstream id, as `history --id`
finds it; a record a provider's webhook settled shows `verdict:SOURCE` on /decisions, on its
history page and in `history`, and refuses a stale page's decision naming it; the log API's
key appears in no log line, page or history. Real guard on SQLite or Redis, real client,
recording upstream, signed webhooks, a local fake of Mailgun's log API."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from smtpguard.cli import main
from smtpguard.server import Server
from tests.console.test_console import alice  # noqa: F401 - logged in to this module's guard
from tests.events.test_events import RCPT, events_config, events_port, sent
from tests.support import Upstream, running_guard
from tests.support import events as ev
from tests.support.console import Operator, console_config, hold
from tests.support.provider_api_fakes import FakeMailgun
from tests.support.utf8 import store_overrides

API_KEY = "key-console-search-0123456789abcdef"


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Any:
    yield from store_overrides(request, tmp, redis_db=11)


@pytest.fixture
async def mailgun() -> AsyncIterator[FakeMailgun]:
    fake = FakeMailgun(API_KEY, "mg.acme.example")
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def guard(
    tmp: Path,
    upstream: Upstream,
    keys: ev.Keys,
    store: dict[str, Any],
    mailgun: FakeMailgun,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Server]:
    monkeypatch.setenv("MAILGUN_API_KEY", API_KEY)
    console = console_config(tmp, upstream)["console"]
    cfg = events_config(tmp, upstream, keys, store, only="mailgun", console=console)
    cfg["providers"][0]["api"] = {
        "kind": "mailgun",
        "key_env": "MAILGUN_API_KEY",
        "domain": mailgun.domain,
        "base_url": mailgun.base_url,
    }
    cfg["reconcile"] = {"events": "15m"}
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as server:
        yield server


async def found(op: Operator, q: str) -> list[tuple[str, str]]:
    page = await op.get(f"/search?q={quote(q, safe='')}")
    assert page.status == 200, page
    return re.findall(r'<tr data-zone="acme" data-key="([^"]+)" data-by="([^"]+)">', page.text)


async def test_the_search_box_finds_a_record_by_each_of_its_ids(
    guard: Server,
    upstream: Upstream,
    alice: Operator,  # noqa: F811
) -> None:
    await sent(guard, upstream, "invoice:1")
    await sent(guard, upstream, "invoice:2")
    assert guard.store is not None
    rec = await guard.store.get("acme", "invoice:1")
    assert rec is not None and rec.message_id and rec.upstream_id
    bare = rec.message_id.strip("<>")

    assert await found(alice, "invoice:1") == [("invoice:1", "key")]
    assert await found(alice, "acme:invoice:1") == [("invoice:1", "key")]
    assert await found(alice, rec.sg_id) == [("invoice:1", "sg id")]
    assert await found(alice, f"sg:{rec.sg_id}") == [("invoice:1", "sg id")]
    assert await found(alice, f"<{bare}>") == [("invoice:1", "Message-ID")]
    assert await found(alice, f"  {bare} ") == [("invoice:1", "Message-ID")]
    assert await found(alice, rec.upstream_id) == [("invoice:1", "upstream id")]

    nothing = await alice.get("/search?q=invoice%3A404")
    assert nothing.status == 200 and "No record is known by" in nothing.text
    assert 'data-key="' not in nothing.text
    too_long = await alice.get("/search?q=" + "x" * 1001)
    assert too_long.status == 400 and "longer than 1000" in too_long.text
    # The box is on every page.
    for path in ("/", "/decisions", "/queue", "/events/acme/invoice%3A1"):
        page = await alice.get(path)
        assert page.status == 200 and 'action="/search"' in page.text, path
    assert len(upstream.received) == 2


async def test_a_verdict_shows_who_settled_it_and_the_api_key_shows_nowhere(
    guard: Server,
    upstream: Upstream,
    alice: Operator,  # noqa: F811
    keys: ev.Keys,
    mailgun: FakeMailgun,
    tmp: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    await hold(guard, upstream, "invoice:9")
    assert guard.store is not None
    held = await guard.store.get("acme", "invoice:9")
    assert held is not None
    message_id = upstream.received[-1].header("Message-ID") or ""
    status, doc = await ev.post(
        events_port(guard), "mailgun", ev.mailgun(keys, ev.mailgun_event("delivered", RCPT, message_id))
    )
    assert status == 200, doc

    decisions = await alice.get("/decisions")
    assert 'data-key="invoice:9"' in decisions.text
    assert "settled as accepted by verdict:mailgun at" in decisions.text
    assert 'value="delivered"' not in decisions.text  # no button on a settled record
    history = await alice.get("/events/acme/invoice%3A9")
    assert "verdict:accepted by verdict:mailgun" in history.text
    assert "verdict accepted via events mailgun" in history.text
    stale = await alice.post(
        "/decide", {"zone": "acme", "key": "invoice:9", "version": str(held.version), "action": "retry"}
    )
    assert stale.status == 409 and "already resolved by verdict:mailgun at" in stale.text
    search = await alice.get("/search?q=invoice%3A9")
    assert "settled as accepted by verdict:mailgun at" in search.text

    code = await asyncio.to_thread(main, ["history", "acme", "invoice:9", "-c", str(tmp / "smtpguard.yaml")])
    printed = capsys.readouterr().out
    assert code == 0 and "verdict:mailgun verdict:accepted: unknown -> delivered" in printed, printed
    assert "verdict accepted via events mailgun" in printed

    # The log API refused once (logged), then answered: its key is in no log, page or history.
    mailgun.fail(401)
    assert guard.reconciler is not None
    refused, *_ = await guard.reconciler.poll()
    assert refused.error is not None
    (answered,) = await guard.reconciler.poll()
    assert answered.advanced, answered
    assert any(r.name == "smtpguard.verdicts" for r in caplog.records)
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    for text in (logged, printed, decisions.text, history.text, search.text):
        assert API_KEY not in text
    assert len(upstream.received) == 1
