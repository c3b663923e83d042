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
from tests.support import Behaviour, Upstream, base_config, message, running_guard, send, write_config
from tests.support.console import Operator, console_config, console_port, hold
from tests.support.utf8 import store_overrides


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


async def test_session_cookie_flags_and_a_session_only_after_login(guard: Server) -> None:
    url = f"http://127.0.0.1:{console_port(guard)}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(url + "/login") as r:
            assert "sg_console" not in r.cookies
            form_cookie = r.cookies["sg_login"]
            page = await r.text()
        assert form_cookie["httponly"] and form_cookie["samesite"] == "Strict" and not form_cookie["secure"]
        assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
        csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        form = {"csrf": csrf, "username": "alice", "password": "alice-pass-1"}
        async with http.post(url + "/login", data=form, allow_redirects=False) as r:
            assert r.status == 303
            session = r.cookies["sg_console"]
        assert session.value != csrf and session["httponly"] and session["samesite"] == "Strict"


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
        ("console:alice", "suppress:add", "Gone@example.net"),
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


async def test_login_pages_keep_no_server_state(guard: Server, alice: Operator) -> None:
    """Requests for the login form cannot crowd out the sessions of operators logged in."""
    assert guard.console is not None
    before = len(guard.console.sessions._by_token)
    anon = Operator(console_port(guard))
    try:
        for _ in range(200):
            assert (await anon.get("/login")).status == 200
        assert len(guard.console.sessions._by_token) == before
        assert (await alice.get("/decisions")).status == 200
    finally:
        await anon.close()


async def test_a_login_or_logout_without_its_csrf_token_is_403(guard: Server, alice: Operator) -> None:
    anon = Operator(console_port(guard))
    try:
        await anon.get("/login")
        form = {"username": "alice", "password": "alice-pass-1"}
        assert (await anon.post("/login", form, csrf=False)).status == 403
        assert (await anon.post("/login", {**form, "csrf": "guessed"}, csrf=False)).status == 403
    finally:
        await anon.close()
    assert (await alice.post("/logout", {}, csrf=False)).status == 403
    assert (await alice.get("/decisions")).url.endswith("/decisions")


async def test_parallel_guesses_are_limited_too(tmp: Path, upstream: Upstream, store: dict[str, Any]) -> None:
    import asyncio

    cfg = console_config(tmp, upstream, **store, limits={"auth_failures": 3, "auth_failure_window": "5m"})
    async with running_guard(cfg) as guard:
        ops = [Operator(console_port(guard)) for _ in range(8)]
        try:
            for op in ops:
                op.csrf = (await op.get("/login")).csrf
            results = await asyncio.gather(
                *(
                    op.post("/login", {"username": "alice", "password": f"guess-{i}"})
                    for i, op in enumerate(ops)
                )
            )
            statuses = sorted(r.status for r in results)
            assert statuses.count(401) == 3 and statuses.count(429) == 5, statuses
        finally:
            for op in ops:
                await op.close()


async def test_console_login_failures_never_lock_smtp_clients_out(guard: Server) -> None:
    anon = Operator(console_port(guard))
    try:
        for _ in range(6):
            assert (await anon.login("alice", "wrong")).status in (401, 429)
    finally:
        await anon.close()
    # The app on the same address still authenticates and sends.
    assert (await send(guard.ports[0], message("after-typos"))).code == 250


async def test_a_stale_page_after_an_earlier_decision_cycle_says_the_record_changed(
    guard: Server, upstream: Upstream, alice: Operator, bob: Operator
) -> None:
    await hold(guard, upstream, "invoice:9", state="failed")
    assert guard.store is not None
    first = await guard.store.get("acme", "invoice:9")
    assert first is not None
    assert (
        await alice.post("/decide", decide_form("acme", "invoice:9", first.version, "release"))
    ).status == 200
    upstream.handler.script.append(Behaviour(data="554 5.7.1 refused again"))
    assert (await send(guard.ports[0], message("invoice:9"))).code == 554
    stale = await bob.post("/decide", decide_form("acme", "invoice:9", first.version, "release"))
    assert stale.status == 409 and "changed since this page was shown (now failed)" in stale.text


async def test_a_viewer_gets_403_on_every_post(guard: Server) -> None:
    victor = Operator(console_port(guard))
    try:
        await victor.login("victor")
        for path, data in (
            ("/zones/acme/resume", {}),
            ("/suppression/acme/remove", {"address": "x@example.com"}),
            ("/decide", decide_form("acme", "k", 1, "release")),
        ):
            assert (await victor.post(path, data)).status == 403, path
        assert (await victor.post("/logout", {})).url.endswith("/login")
    finally:
        await victor.close()


async def test_a_reload_that_removes_an_operator_ends_their_session(
    tmp: Path, upstream: Upstream, store: dict[str, Any]
) -> None:
    path = tmp / "smtpguard.yaml"
    cfg = console_config(tmp, upstream, **store)
    async with running_guard(cfg, config_path=path) as guard:
        bob = Operator(console_port(guard))
        try:
            await bob.login("bob")
            assert (await bob.get("/decisions")).url.endswith("/decisions")
            cfg["console"]["operators"] = [o for o in cfg["console"]["operators"] if o["username"] != "bob"]
            write_config(path, cfg)
            await guard.reload()
            assert (await bob.get("/decisions")).url.endswith("/login")
            assert (await bob.login("bob")).status == 401
        finally:
            await bob.close()


async def test_the_history_page_escapes_what_providers_answered(
    guard: Server, upstream: Upstream, alice: Operator
) -> None:
    upstream.handler.script.append(Behaviour(data='554 5.7.1 <img src=x onerror="alert(1)">'))
    assert (await send(guard.ports[0], message("invoice:x"))).code == 554
    page = await alice.get("/events/acme/invoice%3Ax")
    assert "<img src=x" not in page.text and "&lt;img src=x" in page.text


async def test_cookies_are_secure_under_tls(tmp: Path, upstream: Upstream) -> None:
    from tests.support.hostile import make_cert

    cert, key = make_cert(tmp)
    cfg = console_config(tmp, upstream)
    cfg["console"]["tls"] = {"cert": str(cert), "key": str(key)}
    async with running_guard(cfg) as guard:
        url = f"https://127.0.0.1:{console_port(guard)}"
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            async with http.get(url + "/login", ssl=False) as r:
                assert r.cookies["sg_login"]["secure"]
                page = await r.text()
            csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
            form = {"csrf": csrf, "username": "alice", "password": "alice-pass-1"}
            async with http.post(url + "/login", data=form, allow_redirects=False, ssl=False) as r:
                assert r.status == 303
                session = r.cookies["sg_console"]
            assert session["secure"] and session["httponly"] and session["samesite"] == "Strict"
