"""The console over HTTP (DESIGN.md §14): login, roles, CSRF, cookies, and one decision per
held event enforced by the store — two operators, one decision, the stale page's 409."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from smtpguard.config import ConfigError, loads
from smtpguard.server import Server
from tests.console_support import Operator, console_config, console_port, hold
from tests.support import Upstream, base_config, message, running_guard, send
from tests.utf8_support import store_overrides


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Any:
    yield from store_overrides(request, tmp, redis_db=9)


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream, store: dict[str, Any]) -> AsyncIterator[Server]:
    async with running_guard(console_config(tmp, upstream, **store)) as server:
        yield server


@pytest.fixture
async def alice(guard: Server) -> AsyncIterator[Operator]:
    op = Operator(console_port(guard))
    assert (await op.login("alice")).status == 200
    yield op
    await op.close()


@pytest.fixture
async def bob(guard: Server) -> AsyncIterator[Operator]:
    op = Operator(console_port(guard))
    assert (await op.login("bob")).status == 200
    yield op
    await op.close()


def decide_form(zone: str, key: str, version: int, action: str) -> dict[str, str]:
    return {"zone": zone, "key": key, "version": str(version), "action": action}


async def test_two_operators_one_unknown_event_one_decision(
    guard: Server, upstream: Upstream, alice: Operator, bob: Operator
) -> None:
    await hold(guard, upstream, "invoice:1044")
    assert guard.store is not None
    held = await guard.store.get("acme", "invoice:1044")
    assert held is not None
    # Both load the decisions page: each sees the buttons.
    for op in (alice, bob):
        page = await op.get("/decisions")
        assert 'data-key="invoice:1044"' in page.text and 'value="delivered"' in page.text
    done = await alice.post("/decide", decide_form("acme", "invoice:1044", held.version, "delivered"))
    assert done.status == 200 and done.url.endswith("/decisions")
    # Bob's page was loaded before: his decision is refused, naming who decided.
    stale = await bob.post("/decide", decide_form("acme", "invoice:1044", held.version, "retry"))
    assert stale.status == 409 and "already resolved by console:alice at" in stale.text
    # Everyone now sees the decision and no button.
    for op in (alice, bob):
        page = await op.get("/decisions")
        assert 'data-key="invoice:1044"' in page.text and "by console:alice at" in page.text
        assert 'value="retry"' not in page.text and 'value="delivered"' not in page.text
        history = await op.get("/events/acme/invoice%3A1044")
        assert "resolve:delivered by console:alice" in history.text
    rec = await guard.store.get("acme", "invoice:1044")
    assert rec is not None and rec.state.value == "delivered"
    assert [e.action for e in rec.audit] == ["resolve:delivered"]
    # Nothing was sent again: the upstream saw the one copy whose reply was lost.
    assert len(upstream.received) == 1


async def test_releasing_a_failed_event_sends_it_exactly_once(
    guard: Server, upstream: Upstream, alice: Operator, bob: Operator
) -> None:
    await hold(guard, upstream, "invoice:7", state="failed")
    assert guard.store is not None
    held = await guard.store.get("acme", "invoice:7")
    assert held is not None
    assert (
        await alice.post("/decide", decide_form("acme", "invoice:7", held.version, "release"))
    ).status == 200
    assert (
        await bob.post("/decide", decide_form("acme", "invoice:7", held.version, "release"))
    ).status == 409
    # The application's retry now goes through, once; a second retry is a duplicate.
    assert upstream.received == []
    assert (await send(guard.ports[0], message("invoice:7"))).code == 250
    again = await send(guard.ports[0], message("invoice:7"))
    assert again.code == 250 and "duplicate" in again.text
    assert len(upstream.received) == 1


async def test_a_viewer_sees_but_every_post_is_403(guard: Server, upstream: Upstream) -> None:
    await hold(guard, upstream, "invoice:1")
    assert guard.store is not None
    held = await guard.store.get("acme", "invoice:1")
    assert held is not None
    victor = Operator(console_port(guard))
    try:
        assert (await victor.login("victor")).status == 200
        page = await victor.get("/decisions")
        assert 'data-key="invoice:1"' in page.text and 'name="action"' not in page.text
        for path, data in (
            ("/decide", decide_form("acme", "invoice:1", held.version, "retry")),
            ("/zones/acme/pause", {}),
            ("/suppression/acme/add", {"address": "x@example.com"}),
        ):
            assert (await victor.post(path, data)).status == 403
        assert not await guard.store.is_paused("acme")
        assert await guard.store.suppress_list("acme") == []
        rec = await guard.store.get("acme", "invoice:1")
        assert rec is not None and rec.state.value == "unknown"
    finally:
        await victor.close()


async def test_a_post_without_its_csrf_token_is_403(
    guard: Server, upstream: Upstream, alice: Operator
) -> None:
    await hold(guard, upstream, "invoice:1")
    assert guard.store is not None
    held = await guard.store.get("acme", "invoice:1")
    assert held is not None
    form = decide_form("acme", "invoice:1", held.version, "retry")
    assert (await alice.post("/decide", form, csrf=False)).status == 403
    assert (await alice.post("/decide", {**form, "csrf": "forged"}, csrf=False)).status == 403
    assert (await alice.post("/zones/acme/pause", {}, csrf=False)).status == 403
    rec = await guard.store.get("acme", "invoice:1")
    assert rec is not None and rec.state.value == "unknown" and not await guard.store.is_paused("acme")


async def test_every_page_needs_a_login(guard: Server) -> None:
    anon = Operator(console_port(guard))
    try:
        for path in ("/", "/decisions", "/queue", "/suppression/acme", "/events/acme/x", "/records/acme"):
            page = await anon.get(path)
            assert page.url.endswith("/login"), path
        assert (await anon.post("/zones/acme/pause", {}, csrf=False)).status == 403
        wrong = await anon.login("alice", "not-her-password")
        assert wrong.status == 401 and "Wrong username or password" in wrong.text
        assert (await anon.get("/")).url.endswith("/login")
    finally:
        await anon.close()


async def test_session_cookie_flags_and_a_new_session_at_login(guard: Server) -> None:
    url = f"http://127.0.0.1:{console_port(guard)}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(url + "/login") as r:
            before = r.cookies["sg_console"]
            page = await r.text()
        assert before["httponly"] and before["samesite"] == "Strict" and not before["secure"]
        assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
        csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        form = {"csrf": csrf, "username": "alice", "password": "alice-pass-1"}
        async with http.post(url + "/login", data=form, allow_redirects=False) as r:
            assert r.status == 303
            after = r.cookies["sg_console"]
        assert after.value != before.value and after["httponly"] and after["samesite"] == "Strict"


async def test_login_failures_are_limited_per_ip(
    tmp: Path, upstream: Upstream, store: dict[str, Any]
) -> None:
    cfg = console_config(tmp, upstream, **store, limits={"auth_failures": 3, "auth_failure_window": "5m"})
    async with running_guard(cfg) as guard:
        op = Operator(console_port(guard))
        try:
            for _ in range(3):
                assert (await op.login("alice", "wrong")).status == 401
            limited = await op.login("alice")  # even the right password, now
            assert limited.status == 429 and "Too many failed logins" in limited.text
        finally:
            await op.close()


async def test_pause_resume_and_suppression_are_audited_as_the_console_user(
    guard: Server, alice: Operator
) -> None:
    assert guard.store is not None
    assert (await alice.post("/zones/acme/pause", {})).status == 200
    assert await guard.store.is_paused("acme")
    assert "Resume" in (await alice.get("/")).text
    assert (await alice.post("/zones/acme/resume", {})).status == 200
    assert not await guard.store.is_paused("acme")
    added = await alice.post(
        "/suppression/acme/add", {"address": "Gone@Example.net", "reason": "asked by phone"}
    )
    assert added.status == 200 and "asked by phone" in added.text
    found = await alice.get("/suppression/acme?q=gone")
    assert 'data-address="gone@example.net"' in found.text
    assert (await alice.post("/suppression/acme/remove", {"address": "gone@example.net"})).status == 200
    assert await guard.store.suppress_list("acme") == []
    log = await guard.store.audit_log("acme", 0)
    assert [(e.actor, e.action, e.key) for e in reversed(log)] == [
        ("console:alice", "pause", ""),
        ("console:alice", "resume", ""),
        ("console:alice", "suppress:add", "Gone@Example.net"),
        ("console:alice", "suppress:remove", "gone@example.net"),
    ]
    bad = await alice.post("/suppression/acme/add", {"address": "not an address"})
    assert bad.status == 400


async def test_pages_escape_what_clients_wrote(guard: Server, upstream: Upstream, alice: Operator) -> None:
    key = "<script>alert(1)</script>"
    await hold(guard, upstream, key)
    page = await alice.get("/decisions")
    assert "<script>alert(1)</script>" not in page.text and "&lt;script&gt;" in page.text


def test_a_console_off_loopback_needs_tls(tmp: Path) -> None:
    cfg = base_config(tmp, 2525, console={"address": "0.0.0.0:9590", "operators": []})
    import json

    with pytest.raises(ConfigError, match=r"console\.tls is required"):
        loads(json.dumps(cfg))
