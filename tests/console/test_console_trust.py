"""The console's trust boundaries (DESIGN.md §18, "The console"): login failures limited per
address and per username, X-Forwarded-For read only from trusted proxies, sessions that end
when their operator's hash or role changes or a login starts a new one, and the Host
allow-list (421). Real clients from several loopback source addresses, a real console, real
reloads of a real config file."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from smtpguard.config import ConfigError, loads
from smtpguard.server import Server
from tests.support import Upstream, base_config, password_hash, running_guard, write_config
from tests.support.console import PASSWORDS, Operator, console_config, console_port
from tests.support.utf8 import store_overrides

LIMITS = {"auth_failures": 3, "auth_failure_window": "5m"}


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Any:
    yield from store_overrides(request, tmp, redis_db=10)


@pytest.fixture
async def limited(tmp: Path, upstream: Upstream) -> AsyncIterator[Server]:
    async with running_guard(console_config(tmp, upstream, limits=LIMITS)) as guard:
        yield guard


async def attempt(port: int, username: str, password: str, source: str, **kw: Any) -> int:
    """One login from its own client at `source`; the status it got."""
    op = Operator(port, source=source, **kw)
    try:
        return (await op.login(username, password)).status
    finally:
        await op.close()


def failed_logins(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.client_ip for r in caplog.records if r.getMessage() == "console: login failed"]  # type: ignore[attr-defined]


# --- login limits ------------------------------------------------------------------------------
async def test_guesses_from_many_addresses_count_against_the_username(
    tmp: Path, upstream: Upstream, store: dict[str, Any]
) -> None:
    async with running_guard(console_config(tmp, upstream, limits=LIMITS, **store)) as guard:
        port = console_port(guard)
        statuses = [await attempt(port, "alice", f"guess-{n}", f"127.0.0.{n}") for n in (2, 3, 4)]
        assert statuses == [401, 401, 401]
        # A fresh address with the right password: alice's own count is full.
        assert await attempt(port, "alice", PASSWORDS["alice"], "127.0.0.5") == 429
        # The address itself is not limited: bob logs in from it.
        assert await attempt(port, "bob", PASSWORDS["bob"], "127.0.0.5") == 200


async def test_guesses_at_many_usernames_count_against_the_address(limited: Server) -> None:
    port = console_port(limited)
    statuses = [await attempt(port, name, "wrong", "127.0.0.2") for name in ("alice", "bob", "nobody")]
    assert statuses == [401, 401, 401]
    assert await attempt(port, "victor", PASSWORDS["victor"], "127.0.0.2") == 429
    # alice has one failure of three: from another address she logs in.
    assert await attempt(port, "alice", PASSWORDS["alice"], "127.0.0.3") == 200


async def test_parallel_guesses_from_many_addresses_at_one_username_are_limited(limited: Server) -> None:
    port = console_port(limited)
    ops = [Operator(port, source=f"127.0.0.{n}") for n in range(2, 10)]
    try:
        for op in ops:
            op.csrf = (await op.get("/login")).csrf
        results = await asyncio.gather(
            *(op.post("/login", {"username": "alice", "password": f"guess-{i}"}) for i, op in enumerate(ops))
        )
        statuses = sorted(r.status for r in results)
        assert statuses.count(401) == 3 and statuses.count(429) == 5, statuses
    finally:
        for op in ops:
            await op.close()


# --- X-Forwarded-For -----------------------------------------------------------------------------
async def test_x_forwarded_for_from_an_untrusted_peer_is_ignored(
    limited: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "smtpguard.console")
    port = console_port(limited)
    for n, name in enumerate(("u1", "u2", "u3")):
        xff = {"X-Forwarded-For": f"203.0.113.{n + 1}"}
        assert await attempt(port, name, "wrong", "127.0.0.2", headers=xff) == 401
    # A new forged address changes nothing: the peer 127.0.0.2 is what counts.
    assert await attempt(port, "u4", "wrong", "127.0.0.2", headers={"X-Forwarded-For": "203.0.113.9"}) == 429
    assert failed_logins(caplog) == ["127.0.0.2"] * 3


async def test_x_forwarded_for_from_a_trusted_proxy_names_the_client(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "smtpguard.console")
    cfg = console_config(tmp, upstream, limits=LIMITS)
    cfg["console"]["trusted_proxies"] = ["127.0.0.2/32", "10.9.0.0/16"]
    async with running_guard(cfg) as guard:
        port = console_port(guard)

        async def via_proxy(name: str, xff: str, source: str = "127.0.0.2") -> int:
            return await attempt(port, name, "wrong", source, headers={"X-Forwarded-For": xff})

        # The client puts a forged address first; the proxy appends the one it saw.
        for n, name in enumerate(("u1", "u2", "u3")):
            assert await via_proxy(name, f"198.51.100.{n}, 203.0.113.7") == 401
        # 203.0.113.7 is full, whatever it forges, also behind a second trusted hop.
        assert await via_proxy("u4", "203.0.113.7") == 429
        assert await via_proxy("u5", "198.51.100.77, 203.0.113.7, 10.9.3.4") == 429
        # Another client behind the same proxy has a bucket of its own.
        assert await via_proxy("u6", "203.0.113.8") == 401
        # The same header from a peer that is not a trusted proxy names only that peer.
        assert await via_proxy("u7", "203.0.113.8", source="127.0.0.3") == 401
        # A proxy that sent no header: the proxy's own address.
        assert await attempt(port, "u8", "wrong", "127.0.0.2") == 401
    assert failed_logins(caplog) == ["203.0.113.7"] * 3 + ["203.0.113.8", "127.0.0.3", "127.0.0.2"]


# --- sessions ----------------------------------------------------------------------------------
async def test_a_reload_that_changes_a_hash_or_demotes_ends_those_sessions(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp / "smtpguard.yaml"
    cfg = console_config(tmp, upstream)
    async with running_guard(cfg, config_path=path) as guard:
        port = console_port(guard)
        alice, bob, victor = Operator(port), Operator(port), Operator(port)
        try:
            for op, name in ((alice, "alice"), (bob, "bob"), (victor, "victor")):
                assert (await op.login(name)).status == 200
            ops = {o["username"]: o for o in cfg["console"]["operators"]}
            ops["alice"]["password_hash"] = password_hash("alice-new-pass")
            ops["bob"]["role"] = "viewer"
            write_config(path, cfg)
            caplog.clear()
            with caplog.at_level(logging.INFO, "smtpguard"):
                assert await guard.reload()
            assert not [r for r in caplog.records if "restart" in r.getMessage()], caplog.text
            assert (await alice.get("/decisions")).url.endswith("/login")
            assert (await bob.get("/decisions")).url.endswith("/login")
            # victor's hash and role did not change: his session goes on.
            assert (await victor.get("/decisions")).url.endswith("/decisions")
            assert (await alice.login("alice")).status == 401
            assert (await alice.login("alice", "alice-new-pass")).status == 200
            assert (await alice.get("/decisions")).url.endswith("/decisions")
            # bob logs in again, as what he now is.
            assert (await bob.login("bob")).status == 200
            assert (await bob.post("/zones/acme/pause", {})).status == 403
        finally:
            for op in (alice, bob, victor):
                await op.close()


async def test_a_login_ends_the_operators_earlier_sessions_and_never_reuses_a_cookie(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(console_config(tmp, upstream)) as guard:
        port = console_port(guard)
        url = f"http://127.0.0.1:{port}"
        first, second = Operator(port), Operator(port)
        try:
            assert (await first.login("alice")).status == 200
            assert (await second.login("alice")).status == 200
            assert (await first.get("/decisions")).url.endswith("/login")
            assert (await second.get("/decisions")).url.endswith("/decisions")
        finally:
            await first.close()
            await second.close()
        # A cookie planted before the login, or a session already held in that browser, is
        # never what the login hands back, and the one held is over.
        held = Operator(port)
        assert (await held.login("bob")).status == 200
        bobs = next(c.value for c in held.session.cookie_jar if c.key == "sg_console")
        assert (await held.get("/decisions")).url.endswith("/decisions")
        await held.close()

        async def browser(cookie: str) -> aiohttp.ClientSession:
            http = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
            http.cookie_jar.update_cookies({"sg_console": cookie}, URL(url))
            return http

        for planted in ("planted-by-someone-else", bobs):
            async with await browser(planted) as http:
                async with http.get(url + "/login") as r:
                    # The login form's token (bob's page also has his logout form's).
                    csrf = (await r.text()).rsplit('name="csrf" value="', 1)[1].split('"', 1)[0]
                form = {"csrf": csrf, "username": "alice", "password": PASSWORDS["alice"]}
                async with http.post(url + "/login", data=form, allow_redirects=False) as r:
                    assert r.status == 303
                    given = r.cookies["sg_console"].value
                assert given not in (planted, bobs)
                async with http.get(url + "/decisions") as r:
                    assert str(r.url).endswith("/decisions")
        async with await browser(bobs) as stale, stale.get(url + "/decisions") as r:
            assert str(r.url).endswith("/login")


async def test_a_reload_names_what_needs_a_restart_and_removing_the_console_stops_it(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp / "smtpguard.yaml"
    cfg = console_config(tmp, upstream)
    async with running_guard(cfg, config_path=path) as guard:
        port = console_port(guard)
        alice = Operator(port)
        try:
            assert (await alice.login("alice")).status == 200
            cfg["console"]["address"] = "127.0.0.1:1"
            cfg["console"]["hosts"] = ["console.example"]
            write_config(path, cfg)
            caplog.clear()
            with caplog.at_level(logging.INFO, "smtpguard"):
                assert await guard.reload()
            restart = [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]
            assert restart == ["console.address changes take effect only after a restart"], restart
            # Still on the old port, and what a reload does change is applied.
            assert (await alice.get("/decisions")).url.endswith("/decisions")
            async with alice.session.get(alice.base + "/login", headers={"Host": "console.example"}) as r:
                assert r.status == 200
            del cfg["console"]
            write_config(path, cfg)
            assert await guard.reload()
            assert guard.console is None
            with pytest.raises(aiohttp.ClientConnectionError):
                await alice.get("/decisions")
        finally:
            await alice.close()


# --- Host allow-list ---------------------------------------------------------------------------
async def raw(port: int, request: bytes, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """One HTTP request as bytes (a browser's client would fix what these tests break)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()
        await writer.wait_closed()
    return int(answer.split(b" ", 2)[1]), answer


async def test_a_foreign_host_is_421_and_the_allowed_ones_are_served(tmp: Path, upstream: Upstream) -> None:
    cfg = console_config(tmp, upstream)
    cfg["console"]["hosts"] = ["Console.Example.COM", "alt.example:8443", "[2001:db8::7]"]
    async with running_guard(cfg) as guard:
        port = console_port(guard)
        alice = Operator(port)
        try:
            assert (await alice.login("alice")).status == 200

            async def status(host: str, method: str = "GET", path: str = "/decisions") -> int:
                data = {"csrf": alice.csrf} if method == "POST" else None
                async with alice.session.request(
                    method, alice.base + path, headers={"Host": host}, data=data, allow_redirects=False
                ) as r:
                    return r.status

            for host in (
                f"127.0.0.1:{port}",
                "127.0.0.1",
                "127.0.0.1:8080",
                "console.example.com.",
                "CONSOLE.example.com:443",
                "alt.example:8443",
                "[2001:DB8:0::7]:9",
            ):
                assert await status(host) == 200, host
            for host in (
                f"attacker.example:{port}",
                "attacker.example",
                "alt.example:8444",
                f"localhost:{port}",
                "127.0.0.2",
                "[::1]",
                "console.example.com.evil",
            ):
                assert await status(host) == 421, host
            async with alice.session.get(alice.base + "/", headers={"Host": "attacker.example"}) as r:
                assert r.status == 421 and "console.hosts" in await r.text()
            # A change through a rebinding name never happens, whatever the session.
            assert await status(f"attacker.example:{port}", "POST", "/zones/acme/pause") == 421
            assert guard.store is not None and not await guard.store.is_paused("acme")
            assert await status("attacker.example", "GET", "/login") == 421
        finally:
            await alice.close()
        missing, body = await raw(port, b"GET /login HTTP/1.0\r\n\r\n")
        assert missing == 400 and b"Host" in body
        assert (await raw(port, b"GET /login HTTP/1.1\r\nHost: [::1\r\nConnection: close\r\n\r\n"))[0] == 400
        assert (await raw(port, b"GET /login HTTP/1.1\r\nHost: ::1\r\nConnection: close\r\n\r\n"))[0] == 400
        two = f"GET /login HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: attacker.example\r\n\r\n"
        assert (await raw(port, two.encode()))[0] == 400
        # The absolute form's authority is the request's host (RFC 9112 §3.2.2), not the header.
        absolute = (
            b"GET http://attacker.example/login HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        assert (await raw(port, absolute))[0] == 421
        ok = f"GET /login HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
        assert (await raw(port, ok))[0] == 200


async def test_a_console_on_ipv6_loopback_answers_its_bracketed_address(
    tmp: Path, upstream: Upstream
) -> None:
    cfg = console_config(tmp, upstream)
    cfg["console"]["address"] = "[::1]:0"
    async with running_guard(cfg) as guard:
        port = console_port(guard)
        for host, want in ((f"[::1]:{port}", 200), ("[0:0::1]", 200), ("127.0.0.1", 421)):
            req = f"GET /login HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            assert (await raw(port, req, host="::1"))[0] == want, host


# --- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("trusted_proxies", ["10.0.0.1/8"], r"console\.trusted_proxies\[0\] \(line \d+\).*host bits"),
        ("trusted_proxies", ["proxy.example"], r"console\.trusted_proxies\[0\] \(line \d+\)"),
        ("hosts", ["ok.example", "a b"], r"console\.hosts\[1\] \(line \d+\)"),
        ("hosts", ["::1"], r"console\.hosts\[0\] \(line \d+\).*brackets"),
    ],
)
def test_bad_console_trust_settings_name_their_path_and_line(
    tmp: Path, key: str, value: list[str], problem: str
) -> None:
    import yaml

    cfg = base_config(tmp, 2525, console={"address": "127.0.0.1:9590", "operators": [], key: value})
    with pytest.raises(ConfigError, match=problem):
        loads(yaml.safe_dump(cfg, sort_keys=False))


async def test_the_standalone_console_ends_a_session_on_sighup_after_a_hash_change(
    tmp: Path, upstream: Upstream
) -> None:
    import re
    import signal
    import sys

    from smtpguard.store import store_from_url

    path = tmp / "smtpguard.yaml"
    cfg = console_config(tmp, upstream)
    write_config(path, cfg)
    store = store_from_url(loads(path.read_text()).store.url)
    await store.open()  # `smtpguard console` never creates a store
    await store.close()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smtpguard", "console", "-c", str(path), stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    seen: list[str] = []

    async def until(pattern: str) -> re.Match[str]:
        async def scan() -> re.Match[str]:
            assert proc.stderr is not None
            while line := (await proc.stderr.readline()).decode():
                seen.append(line)
                if found := re.search(pattern, line):
                    return found
            raise AssertionError(f"the console exited: {''.join(seen)}")

        return await asyncio.wait_for(scan(), 20)

    try:
        alice = Operator(int((await until(r"\(port (\d+)\)")).group(1)))
        try:
            assert (await alice.login("alice")).status == 200
            assert (await alice.get("/decisions")).url.endswith("/decisions")
            cfg["console"]["operators"][0]["password_hash"] = password_hash("alice-new-pass")
            write_config(path, cfg)
            proc.send_signal(signal.SIGHUP)
            await until("config reloaded")
            assert (await alice.get("/decisions")).url.endswith("/login")
            assert (await alice.login("alice", "alice-new-pass")).status == 200
        finally:
            await alice.close()
    finally:
        if proc.returncode is None:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 10) == 0


@pytest.mark.parametrize(
    ("address", "hosts", "names"),
    [
        ("127.0.0.1:9590", [], [("127.0.0.1", None)]),
        ("[::1]:9590", [], [("::1", None)]),
        ("localhost:9590", [], [("localhost", None)]),
        # No browser is sent to a wildcard: only the names listed are answered.
        ("0.0.0.0:9590", ["console.example.com"], [("console.example.com", None)]),
        ("[::]:9590", ["[2001:db8::7]:443"], [("2001:db8::7", 443)]),
    ],
)
def test_the_hosts_a_console_answers(
    tmp: Path, address: str, hosts: list[str], names: list[tuple[str, int | None]]
) -> None:
    from smtpguard.config import ConsoleConfig
    from smtpguard.console.trust import allowed

    (tmp / "c.pem").write_text("")
    (tmp / "c.key").write_text("")
    tls = {"cert": str(tmp / "c.pem"), "key": str(tmp / "c.key")}
    console = ConsoleConfig.model_validate({"address": address, "hosts": hosts, "tls": tls})
    assert sorted(allowed(console), key=str) == sorted(names, key=str)


async def test_a_username_no_store_can_hold_is_counted_not_a_500(
    tmp: Path, upstream: Upstream, request: pytest.FixtureRequest
) -> None:
    """PostgreSQL's text cannot hold NUL: what anyone types as a username is counted under a
    key every store takes (it was 503, the store refusing the key, and never counted)."""
    from smtpguard.store import store_from_url
    from tests.support.postgres import PostgresServer, reset

    pg: PostgresServer = request.getfixturevalue("postgres_server")
    first = store_from_url(pg.url)
    await first.open()  # the schema, so that there are tables to empty
    await first.close()
    reset(pg.url)
    cfg = console_config(tmp, upstream, limits=LIMITS, store__url=pg.url, store__unsafe=True)
    async with running_guard(cfg) as guard:
        port = console_port(guard)
        odd = "al\x00ice}{" + "x" * 200
        statuses = [await attempt(port, odd, "wrong", f"127.0.0.{n}") for n in (2, 3, 4, 5)]
        assert statuses == [401, 401, 401, 429]
