"""Attacks on the console's login limits and sessions (DESIGN.md §18, "The console") that
the trust tests did not try: a store that answers reads but refuses writes, addresses an
attacker holds by the million, and the replay of a session cookie. Real clients from
loopback addresses, a real console, a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from yarl import URL

from smtpguard.store.redis.connection import _TIMEOUT
from tests.support import RedisServer, Upstream, password_hash, running_guard, write_config
from tests.support.console import PASSWORDS, Operator, console_config, console_port
from tests.support.utf8 import store_overrides

LIMITS = {"auth_failures": 3, "auth_failure_window": "5m"}


@pytest.fixture(params=["redis"])
def redis_store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=11)


async def attempt(port: int, username: str, password: str, source: str) -> int:
    op = Operator(port, source=source)
    try:
        return (await op.login(username, password)).status
    finally:
        await op.close()


async def test_a_store_that_refuses_writes_never_lets_a_guess_go_uncounted(
    tmp: Path, upstream: Upstream, redis_store: dict[str, Any], redis_server: RedisServer
) -> None:
    """Redis refusing writes but answering reads (min-replicas-to-write with no replica; a
    full maxmemory under noeviction, a demoted primary do the same): every wrong password
    was answered 503 and never counted, the right one logged in: unlimited guessing with
    an oracle. A login the limiter cannot count must not be tried at all. A store that
    hangs held already (every login 503 at the store's deadline)."""
    cfg = console_config(tmp, upstream, limits=LIMITS, **redis_store)
    admin = redis.Redis.from_url(redis_server.url)
    async with running_guard(cfg) as guard:
        port = console_port(guard)
        admin.config_set("min-replicas-to-write", 1)
        try:
            statuses = [await attempt(port, "alice", f"guess-{n}", "127.0.0.2") for n in range(6)]
            right = await attempt(port, "alice", PASSWORDS["alice"], "127.0.0.2")
        finally:
            admin.config_set("min-replicas-to-write", 0)
        # Nothing is learnt while nothing can be counted: the right password is answered
        # as the wrong ones are.
        assert set(statuses) == {503} and right == 503, (statuses, right)
        # A store that hangs (every client paused past the store's deadline): the same. The
        # two logins share a username, so they take turns: the second one's store deadline
        # starts as the first one's ends, and the pause must outlast both. A pause of twice
        # the deadline did not always: Redis ends a pause on its next cron tick (up to 100 ms
        # late), at times inside the second login's deadline, and that login, counted in
        # time, went on to 200 (about 1 run in 30).
        admin.execute_command("CLIENT", "PAUSE", str(int((2 * _TIMEOUT + 2) * 1000)), "ALL")
        try:
            hung = await asyncio.gather(
                attempt(port, "alice", "guess-hung", "127.0.0.2"),
                attempt(port, "alice", PASSWORDS["alice"], "127.0.0.5"),
            )
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
            admin.close()
        assert hung == [503, 503], hung
        # Once writes work again, nothing from that time was a free guess the limit missed,
        # and the limit still holds.
        for n in range(3):
            assert await attempt(port, "alice", f"later-{n}", "127.0.0.3") == 401
        assert await attempt(port, "alice", PASSWORDS["alice"], "127.0.0.4") == 429


async def test_an_ipv6_client_is_counted_by_its_64_not_by_each_address_it_holds(
    tmp: Path, upstream: Upstream
) -> None:
    """One IPv6 client holds a /64 (2^64 addresses, privacy addresses change by themselves):
    counted per address, every guess from a new one was a first failure, so the per-address
    limit never stopped one client trying every username. Behind a trusted proxy that
    appends what it saw, as docs/SECURITY.md asks."""
    cfg = console_config(tmp, upstream, limits=LIMITS)
    cfg["console"]["trusted_proxies"] = ["127.0.0.2"]
    async with running_guard(cfg) as guard:
        port = console_port(guard)

        async def via_proxy(name: str, client: str, password: str = "wrong") -> int:
            op = Operator(port, source="127.0.0.2", headers={"X-Forwarded-For": client})
            try:
                return (await op.login(name, password)).status
            finally:
                await op.close()

        statuses = [await via_proxy(f"u{n}", f"2001:db8:0:1::{n:x}") for n in range(1, 4)]
        assert statuses == [401, 401, 401]
        # A fourth address of the same /64, another username: the client's count is full.
        assert await via_proxy("victor", "2001:db8:0:1:ffff::9", PASSWORDS["victor"]) == 429
        # Another /64 is another client.
        assert await via_proxy("victor", "2001:db8:0:2::1", PASSWORDS["victor"]) == 200
        # An IPv4 client written IPv4-mapped is that IPv4 address, and only it.
        for n in range(3):
            assert await via_proxy(f"w{n}", "::ffff:203.0.113.7") == 401
        assert await via_proxy("bob", "203.0.113.7", PASSWORDS["bob"]) == 429
        assert await via_proxy("bob", "203.0.113.8", PASSWORDS["bob"]) == 200


async def test_parallel_guesses_spread_over_two_consoles_on_one_store_are_limited(
    tmp: Path, upstream: Upstream
) -> None:
    """Two instances of one fleet, each with its console, on one store (DESIGN.md §15): a
    login was serialised only within its own process, so each console let a guess pass
    the count while the other's was still being tested."""
    cfg = console_config(tmp, upstream, limits=LIMITS)
    async with running_guard(cfg) as first, running_guard(cfg) as second:
        ops = [
            Operator(console_port(first if n % 2 else second), source=f"127.0.0.{n}") for n in range(2, 14)
        ]
        try:
            for op in ops:
                op.csrf = (await op.get("/login")).csrf
            guesses = [{"username": "alice", "password": f"guess-{i}"} for i in range(len(ops))]
            posts = [op.post("/login", g) for op, g in zip(ops, guesses, strict=True)]
            results = await asyncio.gather(*posts)
        finally:
            for op in ops:
                await op.close()
        statuses = sorted(r.status for r in results)
        assert statuses.count(401) == 3 and statuses.count(429) == 9, statuses


async def test_a_session_cookie_or_csrf_token_replayed_elsewhere_is_refused(
    tmp: Path, upstream: Upstream
) -> None:
    """A cookie copied before logout, and one session's CSRF token sent with another's
    cookie: neither changes anything."""
    async with running_guard(console_config(tmp, upstream)) as guard:
        port = console_port(guard)
        alice, bob, thief = Operator(port), Operator(port), Operator(port)
        try:
            assert (await alice.login("alice")).status == 200
            assert (await bob.login("bob")).status == 200
            # bob's own cookie with alice's token: 403, nothing paused.
            bobs_token = bob.csrf
            bob.csrf = alice.csrf
            assert (await bob.post("/zones/acme/pause", {})).status == 403
            bob.csrf = bobs_token
            stolen = next(c.value for c in alice.session.cookie_jar if c.key == "sg_console")
            thief.session.cookie_jar.update_cookies({"sg_console": stolen}, URL(thief.base))
            thief.csrf = alice.csrf
            assert (await thief.get("/decisions")).url.endswith("/decisions")
            assert (await alice.post("/logout", {})).url.endswith("/login")
            assert (await thief.get("/decisions")).url.endswith("/login")
            assert (await thief.post("/zones/acme/pause", {})).status == 403
            assert guard.store is not None and not await guard.store.is_paused("acme")
            # bob's session was never touched by any of it.
            assert (await bob.post("/zones/acme/pause", {})).url.endswith("/")
            assert await guard.store.is_paused("acme")
        finally:
            for op in (alice, bob, thief):
                await op.close()


async def test_a_login_racing_a_reload_that_changes_the_hash_never_outlives_it(
    tmp: Path, upstream: Upstream
) -> None:
    """The old password is being verified while a reload replaces its hash: whichever
    finishes first, no session opened with the old password is usable afterwards."""
    path = tmp / "smtpguard.yaml"
    cfg = console_config(tmp, upstream)
    async with running_guard(cfg, config_path=path) as guard:
        port = console_port(guard)
        seen: list[int] = []
        for round_ in range(3):
            alice = Operator(port)
            try:
                alice.csrf = (await alice.get("/login")).csrf
                old = PASSWORDS["alice"] if round_ == 0 else f"rotated-{round_}"
                cfg["console"]["operators"][0]["password_hash"] = password_hash(f"rotated-{round_ + 1}")
                write_config(path, cfg)
                login = asyncio.ensure_future(alice.post("/login", {"username": "alice", "password": old}))
                await asyncio.sleep(0.01 * round_)  # three interleavings, each allowed either outcome
                assert await guard.reload()
                seen.append((await login).status)
                assert (await alice.get("/decisions")).url.endswith("/login"), seen
            finally:
                await alice.close()
        assert set(seen) <= {200, 401}, seen


async def test_host_tricks_reach_nothing(tmp: Path, upstream: Upstream) -> None:
    """What a rebinding page or a proxy's client could put in a request line and headers."""
    async with running_guard(console_config(tmp, upstream)) as guard:
        port = console_port(guard)

        async def status(target: str, *headers: str) -> int:
            lines = [f"GET {target} HTTP/1.1", *headers, "Connection: close", "", ""]
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            try:
                writer.write("\r\n".join(lines).encode())
                answer = await asyncio.wait_for(reader.read(65536), 5)
            finally:
                writer.close()
                await writer.wait_closed()
            return int(answer.split(b" ", 2)[1])

        ours = f"127.0.0.1:{port}"
        cases = [
            # X-Forwarded-Host is never read: the Host decides.
            (("/login", "Host: attacker.example", f"X-Forwarded-Host: {ours}"), 421),
            (("/login", f"Host: {ours}", "X-Forwarded-Host: attacker.example"), 200),
            # userinfo, a list, a second Host in other case, a trailing dot, case
            (("/login", f"Host: attacker.example@{ours}"), 400),
            (("/login", f"Host: {ours}@attacker.example"), 400),
            (("/login", f"Host: {ours}, attacker.example"), 400),
            (("/login", f"Host: {ours}", "HOST: attacker.example"), 400),
            (("/login", f"Host: 127.0.0.1.:{port}"), 200),
            (("/login", "Host: 2130706433"), 421),
            (("/login", "Host: 127.1"), 421),
            # the absolute form: its own authority, userinfo dropped
            ((f"http://{ours}@attacker.example/login", f"Host: {ours}"), 421),
            ((f"http://attacker.example@{ours}/login", "Host: attacker.example"), 200),
            (("HTTP://ATTACKER.EXAMPLE/login", f"Host: {ours}"), 421),
            (("http:///login", f"Host: {ours}"), 400),
        ]
        got = [(await status(*request), want) for request, want in cases]
        assert [g for g, _ in got] == [w for _, w in got], list(zip(cases, got, strict=True))


async def test_a_trusted_proxy_written_ipv4_mapped_is_that_ipv4_proxy(tmp: Path, upstream: Upstream) -> None:
    """A console on a dual-stack socket sees an IPv4 proxy as ::ffff:a.b.c.d, and an
    operator may list it so; peers are compared as IPv4, so such an entry never matched:
    every client behind the proxy shared its count, and one guesser locked out all."""
    cfg = console_config(tmp, upstream, limits=LIMITS)
    cfg["console"]["trusted_proxies"] = ["::ffff:127.0.0.2", "::ffff:127.0.8.0/120"]
    async with running_guard(cfg) as guard:
        port = console_port(guard)

        async def via(proxy: str, client: str, name: str, password: str = "wrong") -> int:
            op = Operator(port, source=proxy, headers={"X-Forwarded-For": client})
            try:
                return (await op.login(name, password)).status
            finally:
                await op.close()

        for n in range(3):
            assert await via("127.0.0.2", "203.0.113.7", f"u{n}") == 401
        assert await via("127.0.8.9", "203.0.113.7", "bob", PASSWORDS["bob"]) == 429
        # Another client behind the same proxies is not the guesser.
        assert await via("127.0.0.2", "203.0.113.8", "bob", PASSWORDS["bob"]) == 200
        assert await via("127.0.8.9", "203.0.113.9", "alice", PASSWORDS["alice"]) == 200


async def test_the_standalone_console_names_a_store_change_on_sighup_as_needing_a_restart(
    tmp: Path, upstream: Upstream
) -> None:
    """`smtpguard console` keeps the store it opened: a SIGHUP that moves the store must say
    so, as serve does, not log `config reloaded` alone while the console reads the old one."""
    import re
    import signal
    import sys

    from smtpguard.config import loads
    from smtpguard.store import store_from_url

    path = tmp / "smtpguard.yaml"
    cfg = console_config(tmp, upstream)
    write_config(path, cfg)
    store = store_from_url(loads(path.read_text()).store.url)
    await store.open()
    await store.close()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "smtpguard", "console", "-c", str(path), stderr=asyncio.subprocess.PIPE
    )
    seen: list[str] = []

    async def until(pattern: str) -> None:
        async def scan() -> None:
            assert proc.stderr is not None
            while line := (await proc.stderr.readline()).decode():
                seen.append(line)
                if re.search(pattern, line):
                    return
            raise AssertionError(f"the console exited: {''.join(seen)}")

        await asyncio.wait_for(scan(), 20)

    try:
        await until(r"\(port \d+\)")
        cfg["store"]["url"] = f"sqlite:///{tmp / 'elsewhere.db'}"
        write_config(path, cfg)
        proc.send_signal(signal.SIGHUP)
        await until("config reloaded")
        assert any("store changes take effect only after a restart" in line for line in seen), seen
    finally:
        if proc.returncode is None:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_no_variant_of_a_locked_username_logs_in(tmp: Path, upstream: Upstream) -> None:
    """alice's count is full: her password under a case, width, space or zero-width variant
    of her name is a wrong login like any other, never a way around her count."""
    async with running_guard(console_config(tmp, upstream, limits=LIMITS)) as guard:
        port = console_port(guard)
        for n in range(3):
            assert await attempt(port, "alice", f"guess-{n}", f"127.0.0.{n + 2}") == 401
        assert await attempt(port, "alice", PASSWORDS["alice"], "127.0.0.9") == 429
        fullwidth = "".join(chr(ord(c) + 0xFEE0) for c in "alice")
        variants = ["Alice", "ALICE", "alice ", " alice", fullwidth, "alice\u200b", "alice\x00", "ali\u0441e"]
        statuses = [
            await attempt(port, v, PASSWORDS["alice"], f"127.0.1.{i + 1}") for i, v in enumerate(variants)
        ]
        assert statuses == [401] * len(variants), statuses
