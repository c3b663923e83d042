"""AUTH under attack: brute force lock-out, parallel guessing, timing, garbage payloads, and
secrets (client passwords, AUTH payloads, provider credentials) kept out of every output."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session
from argon2 import Parameters, extract_parameters

from smtpguard.cli import main
from smtpguard.logs import JSONFormatter
from tests.support import PASSWORD, RedisServer, Upstream, base_config, running_guard, write_config
from tests.support.hostile import (
    RawClient,
    SmtpReply,
    message_bytes,
    session,
    submit,
    terminated,
)

# Every hostile case must leave no traceback in the logs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_tracebacks")


def plain(user: str | bytes, password: str | bytes) -> str:
    login = user.encode() if isinstance(user, str) else user
    secret = password.encode() if isinstance(password, str) else password
    return "AUTH PLAIN " + base64.b64encode(b"\0" + login + b"\0" + secret).decode()


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def attempt(port: int, line: str, source_ip: str | None = None) -> tuple[SmtpReply, bool]:
    """One AUTH on a fresh connection; the reply and whether the server then hung up."""
    c = await RawClient.connect(port, source_ip)
    try:
        await c.reply()
        await c.ehlo()
        reply = await c.command(line)
        if reply.code == 421:
            return reply, await c.closed()
        return reply, False
    finally:
        await c.close()


# --- brute force ------------------------------------------------------------------------------
async def test_auth_failures_lock_the_ip_out_with_421_for_the_window(tmp: Path, upstream: Upstream) -> None:
    clock = Clock()
    cfg = base_config(tmp, upstream.port, limits__auth_failures=3, limits__auth_failure_window="5m")
    async with running_guard(cfg, clock=clock) as guard:
        port = guard.ports[0]
        c = await RawClient.connect(port)
        try:
            await c.reply()
            await c.ehlo()
            first = await c.command(plain("acme-app", "guess-1"))
            assert (await c.command("AUTH LOGIN " + b64("acme-app"))).code == 334
            second = await c.command(b64("guess-2"))
            third = await c.command(plain("no-such-user", "guess-3"))
            assert (first.code, first.enhanced) == (535, "5.7.8"), first
            assert (second.code, second.enhanced) == (535, "5.7.8"), second
            assert (third.code, third.enhanced) == (421, "4.7.0"), third
            assert await c.closed()
        finally:
            await c.close()
        # Locked out, even with the right password, on a new connection from that IP ...
        locked, hung_up = await attempt(port, plain("acme-app", PASSWORD))
        assert (locked.code, locked.enhanced) == (421, "4.7.0") and hung_up, locked
        # ... while another client IP is served meanwhile ...
        other = await submit(port, message_bytes("brute:1"), source_ip="127.0.0.2")
        assert other.code == 250, other
        # ... and once the window has passed, the right password works again.
        clock.now += 301
        ok, _ = await attempt(port, plain("acme-app", PASSWORD))
        assert ok.code == 235, ok
    assert len(upstream.received) == 1


async def test_parallel_guesses_from_one_ip_do_not_exceed_the_limit(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, limits__auth_failures=3)
    async with running_guard(cfg) as guard:
        results = await asyncio.gather(
            *(attempt(guard.ports[0], plain("acme-app", f"guess-{i}")) for i in range(12))
        )
    codes = sorted(r.code for r, _ in results)
    assert codes == [421] * 10 + [535] * 2, codes
    assert all(hung_up for r, hung_up in results if r.code == 421)


async def test_bad_user_and_bad_password_cost_the_same(
    tmp: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed AUTH must not tell an unknown user from a known one by its cost: each makes
    one argon2 verification of a hash at the same parameters (an unknown user's is the
    built-in dummy, which must carry what `smtpguard hash-password` makes). Compared by the
    verifications the real hasher is asked for, not by a stopwatch on a shared machine."""
    from smtpguard import passwords

    real = passwords._hasher
    verified: list[Parameters] = []

    class Recording:
        def verify(self, h: str, p: str) -> bool:
            verified.append(extract_parameters(h))
            return real.verify(h, p)

    cfg = base_config(tmp, upstream.port, limits__auth_failures=1000)
    # This one test needs the user's hash at smtpguard's own parameters (tests/support makes
    # cheap ones).
    production = passwords.hash_password(PASSWORD)
    cfg["zones"]["acme"]["users"][0]["password_hash"] = production
    monkeypatch.setattr(passwords, "_hasher", Recording())
    cost: dict[str, list[Parameters]] = {}
    async with running_guard(cfg) as guard, session(guard.ports[0], login=False) as c:
        for label, line in (
            ("bad-user", plain("nobody", PASSWORD)),
            ("bad-password", plain("acme-app", "wrong")),
        ):
            verified.clear()
            reply = await c.command(line)
            assert reply.code == 535, reply
            cost[label] = list(verified)
    assert cost["bad-user"] == cost["bad-password"] == [extract_parameters(production)], cost


async def test_garbage_auth_payloads_get_clear_replies(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, limits__auth_failures=100)
    async with running_guard(cfg) as guard, session(guard.ports[0], login=False) as c:
        cases: list[tuple[str | bytes, int]] = [
            ("AUTH PLAIN not-base64!", 501),
            ("AUTH PLAIN " + b64("only\0two"), 501),
            (plain("acme-app", b"\xff\xfe not utf-8"), 535),
            (plain(b"acme-app\xff", PASSWORD), 535),
            ("AUTH XOAUTH2 abc", 504),
            ("AUTH PLAIN a b c", 501),
        ]
        for line, code in cases:
            reply = await c.command(line)
            assert reply.code == code, (line, reply)
        assert (await c.command("AUTH LOGIN")).code == 334
        long_answer = await c.command(b"A" * 5000 + b"\r\n")
        assert (long_answer.code, long_answer.enhanced) == (501, "5.5.2"), long_answer
        assert (await c.command("AUTH LOGIN")).code == 334
        assert (await c.command("*")).code == 501
        assert (await c.command("AUTH PLAIN")).code == 334
        assert (await c.command("%%%")).code == 501
        assert (await c.login()).code == 235
        assert (await c.login()).code == 503  # already authenticated
    assert upstream.handler.transactions == 0


# --- secrets ----------------------------------------------------------------------------------
PROVIDER_USER = "relay-user"
PROVIDER_SECRET = "Prov1der-Secret-7731"
WRONG_GUESS = "Wr0ng-Guess-4412"


class AuthUpstream(Upstream):
    """The recording upstream, requiring smtpguard's provider credentials."""

    def __init__(self) -> None:
        super().__init__()
        self.logins: list[bool] = []

    def _authenticator(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, data: Any
    ) -> AuthResult:
        ok = isinstance(data, LoginPassword) and (data.login, data.password) == (
            PROVIDER_USER.encode(),
            PROVIDER_SECRET.encode(),
        )
        self.logins.append(ok)
        return AuthResult(success=ok, handled=False)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: SMTP(
                self.handler,
                hostname="upstream",
                authenticator=self._authenticator,
                auth_require_tls=False,
            ),
            "127.0.0.1",
            self.port,
        )


def secret_forms() -> list[str]:
    forms = []
    for secret in (PASSWORD, WRONG_GUESS, PROVIDER_SECRET):
        forms += [secret, b64(secret)]
    for user, secret in (("acme-app", PASSWORD), ("acme-app", WRONG_GUESS), (PROVIDER_USER, PROVIDER_SECRET)):
        forms.append(plain(user, secret).split()[-1])
    return forms


async def test_secrets_never_reach_logs_history_stats_or_replies(
    tmp: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("PROVIDER_PASSWORD", PROVIDER_SECRET)
    upstream = AuthUpstream()
    await upstream.start()
    cfg = base_config(tmp, upstream.port, limits__auth_failures=100)
    cfg["providers"][0].update(username=PROVIDER_USER, password_env="PROVIDER_PASSWORD")
    cfg["log"]["level"] = "debug"
    seen: list[SmtpReply] = []
    try:
        async with running_guard(cfg) as guard:
            port = guard.ports[0]
            async with session(port, login=False) as c:
                seen.append(await c.command(plain("acme-app", WRONG_GUESS)))
                seen.append(await c.command("AUTH LOGIN " + b64("acme-app")))
                seen.append(await c.command(b64(WRONG_GUESS)))
                seen.append(await c.command("AUTH LOGIN"))
                seen.append(await c.command(b64("acme-app")))
                seen.append(await c.command(f"{WRONG_GUESS}!"))  # not base64: logged by aiosmtpd
                # A client that sends its password as a line of its own (after a refused AUTH).
                seen.append(await c.command(b64(PASSWORD)))
                seen.append(await c.command(PASSWORD))
                seen.append(await c.command("AUTH LOGIN " + b64("acme-app")))
                seen.append(await c.command(b64(PASSWORD)))
                seen.append(await c.command("MAIL FROM:<billing@acme.example>"))
                seen.append(await c.command("RCPT TO:<customer@example.com>"))
                seen.append(await c.data(terminated(message_bytes("secret:1"))))
            assert seen[-1].code == 250, seen
            assert guard.store is not None
            record = await guard.store.get("acme", "secret:1")
            assert record is not None
            history = json.dumps(record.to_dict())
        # The provider refuses smtpguard's credentials: the operator-facing error names the
        # provider, never the secret.
        monkeypatch.setenv("PROVIDER_PASSWORD", PROVIDER_SECRET + "-rotated")
        async with running_guard(cfg) as guard:
            refused = await submit(guard.ports[0], message_bytes("secret:2"))
            seen.append(refused)
            assert refused.code == 451, refused
        path = write_config(tmp / "smtpguard.yaml", cfg)
        capsys.readouterr()
        for argv in (
            ["history", "acme", "secret:1", "--json"],
            ["history", "acme", "secret:2", "--json"],
            ["stats", "--json"],
        ):
            assert await asyncio.to_thread(main, [*argv, "-c", str(path)]) == 0
        cli_out = capsys.readouterr().out
    finally:
        await upstream.stop()
    assert upstream.logins[0] and not any(upstream.logins[1:]) and len(upstream.logins) > 1
    assert len(upstream.received) == 1

    formatter = JSONFormatter()
    logs = "\n".join(formatter.format(r) + repr(r.args) for r in caplog.records)
    assert "authentication failed" in logs and "refused smtpguard's credentials" in logs
    outputs = {
        "logs": logs,
        "history": history,
        "history and stats (CLI)": cli_out,
        "replies": "\n".join(map(str, seen)),
    }
    for where, text in outputs.items():
        for form in secret_forms():
            assert form not in text, f"{form!r} appears in {where}"


async def test_a_store_that_refuses_writes_bounds_the_guesses(
    tmp: Path, upstream: Upstream, redis_server: RedisServer
) -> None:
    """Redis answering reads but refusing writes (min-replicas-to-write with no replica; a
    demoted primary or a full noeviction instance do the same): each wrong password was
    answered 451 and never counted, and the right one 235 — unlimited guesses, each telling
    whether it was right. The failures the store could not record are now counted in the
    process, so after the limit the right password is locked out like any other."""
    url = redis_server.url.rsplit("/", 1)[0] + "/12"
    admin = redis.Redis.from_url(url)
    admin.flushdb()
    cfg = base_config(
        tmp,
        upstream.port,
        limits__auth_failures=3,
        limits__auth_failure_window="5m",
        store__url=url,
        store__unsafe=True,
    )
    try:
        async with running_guard(cfg) as guard:
            port = guard.ports[0]
            admin.config_set("min-replicas-to-write", 1)
            try:
                guesses = [(await attempt(port, plain("acme-app", f"guess-{n}")))[0] for n in range(6)]
                right, _ = await attempt(port, plain("acme-app", PASSWORD))
            finally:
                admin.config_set("min-replicas-to-write", 0)
            # The first three could not be counted in the store (451); from then on the
            # address is locked out, and the right password learns nothing.
            assert [g.code for g in guesses[:3]] == [451, 451, 451], guesses
            assert {(g.code, g.enhanced) for g in guesses[3:]} == {(421, "4.7.0")}, guesses
            assert (right.code, right.enhanced) == (421, "4.7.0"), right
            # Another address is not locked out by them.
            other = await submit(port, message_bytes("readonly:1"), source_ip="127.0.0.2")
            assert other.code == 250, other
    finally:
        admin.flushdb()
        admin.close()
    assert len(upstream.received) == 1
