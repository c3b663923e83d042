"""Credential rotation loses nothing (DESIGN.md §16).

Downstream: a user holding `password_hashes: [new, old]` authenticates with either, and
with nothing else. Upstream: smtpguard's password for a provider comes from a
`password_file`, re-read on SIGHUP and once after a 535. The upstream here is a real
aiosmtpd server requiring AUTH; its password is rotated while a client keeps sending, and
every send must get its 250 and reach the upstream exactly once."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from smtpguard.config import ConfigError, loads
from tests.support import (
    PASSWORD,
    UPSTREAM_USER,
    GuardProcess,
    Reply,
    Upstream,
    base_config,
    free_port,
    message,
    password_hash,
    running_guard,
    send,
    write_config,
)

OLD, NEW = "upstream-old-secret", "upstream-new-secret"
SENDERS = 3
PER_SENDER = 20


# --- downstream: password_hashes -------------------------------------------------------------
async def test_both_hashes_of_a_rotation_are_accepted_and_a_third_refused(
    tmp: Path, upstream: Upstream
) -> None:
    cfg = base_config(tmp, upstream.port)
    cfg["zones"]["acme"]["users"] = [
        {"username": "acme-app", "password_hashes": [password_hash("new-pass"), password_hash(PASSWORD)]}
    ]
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        new = await send(port, message("rot:new"), password="new-pass")
        old = await send(port, message("rot:old"), password=PASSWORD)
        third = await send(port, message("rot:third"), password="neither-of-them")
    assert new.code == 250 and old.code == 250, (new, old)
    assert third.code == 535 and third.text.startswith("5.7.8"), third
    assert sorted(k or "" for k in upstream.event_keys()) == ["rot:new", "rot:old"]


@pytest.mark.parametrize(
    ("user", "problem"),
    [
        pytest.param({"password_hash": "H", "password_hashes": ["H"]}, "exactly one", id="both-forms"),
        pytest.param({}, "exactly one", id="neither"),
        pytest.param({"password_hashes": []}, "must not be empty", id="empty-list"),
        pytest.param({"password_hashes": ["H", "plaintext"]}, "argon2", id="not-a-hash"),
        pytest.param({"password_hashes": ["H", "H"]}, "twice", id="same-hash-twice"),
    ],
)
def test_password_hashes_config_errors(tmp: Path, user: dict[str, Any], problem: str) -> None:
    h = password_hash(PASSWORD)

    def real(v: object) -> object:
        # "H" stands for a real argon2 hash, anything else is taken as written.
        return [real(x) for x in v] if isinstance(v, list) else (h if v == "H" else v)

    cfg = base_config(tmp, 2525)
    cfg["zones"]["acme"]["users"] = [{"username": "acme-app", **{k: real(v) for k, v in user.items()}}]
    with pytest.raises(ConfigError) as e:
        loads(yaml.safe_dump(cfg))
    text = "\n".join(e.value.problems)
    assert "zones.acme.users[0]" in text and problem in text, text


# --- upstream: password_file -----------------------------------------------------------------
def rotating_config(tmp: Path, upstream: Upstream, **extra: Any) -> tuple[dict[str, Any], Path]:
    secret = tmp / "upstream.pass"
    secret.write_text(OLD + "\n")
    cfg = base_config(tmp, upstream.port, **extra)
    cfg["providers"][0].update({"username": UPSTREAM_USER, "password_file": str(secret)})
    return cfg, secret


async def flow(port: int, started: asyncio.Event, prefix: str) -> list[tuple[str, Reply]]:
    """SENDERS clients sending PER_SENDER messages each, one after another, as fast as the
    guard answers; `started` is set once the first replies are in."""

    async def one(sender: int) -> list[tuple[str, Reply]]:
        out = []
        for i in range(PER_SENDER):
            key = f"{prefix}:{sender}:{i}"
            out.append((key, await send(port, message(key))))
            if i == 2:
                started.set()
        return out

    batches = await asyncio.gather(*(one(s) for s in range(SENDERS)))
    return [r for batch in batches for r in batch]


def wait_for_line(path: Path, text: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} never logged: {path.read_text()[-2000:]}")
        time.sleep(0.05)


def assert_nothing_lost(results: list[tuple[str, Reply]], upstream: Upstream) -> None:
    failed = [(k, str(r)) for k, r in results if r.code != 250 or "duplicate" in r.text]
    assert failed == [], failed
    counts = Counter(upstream.event_keys())
    assert len(results) == SENDERS * PER_SENDER
    assert sorted(counts) == sorted(k for k, _ in results), "every message reached the upstream"
    assert set(counts.values()) == {1}, "and each exactly once"
    print(f"rotation: sent={len(results)} lost=0 failed=0 upstream_auth_refused={upstream.auth_refused}")


@pytest.mark.parametrize("order", ["file-first", "upstream-first"])
async def test_upstream_password_rotation_with_mail_flowing(tmp: Path, order: str) -> None:
    upstream = Upstream(password=OLD)
    await upstream.start()
    try:
        cfg, secret = rotating_config(tmp, upstream)
        async with running_guard(cfg) as guard:
            started = asyncio.Event()
            sending = asyncio.create_task(flow(guard.ports[0], started, order))
            await started.wait()
            if order == "file-first":
                # The operator writes the new secret; mail keeps flowing on the old one
                # (nobody told smtpguard) until the provider switches and refuses it: the
                # 535 makes smtpguard read the file again and retry on a fresh connection.
                secret.write_text(NEW + "\n")
                # The switch waits on mail arriving after the write, never on a fixed time:
                # a fixed wait let a fast flow end before it, so the rotation went unmet.
                # SENDERS more arrivals show the old secret still in use, and most of the
                # flow (no more than ~SENDERS in flight) is still to come when it switches.
                await upstream.wait_received(len(upstream.received) + SENDERS)
                upstream.rotate(NEW)
            else:
                # The provider switches first; the file follows before the refusal reaches
                # smtpguard, whose one re-read after that 535 must save the message.
                upstream.rotate(NEW, then=lambda: secret.write_text(NEW + "\n"))
            results = await sending
    finally:
        await upstream.stop()
    assert_nothing_lost(results, upstream)
    # The rotation was really met: the old secret was refused at least once.
    assert upstream.auth_refused >= 1 and upstream.password == NEW


async def test_sighup_reads_the_rotated_password_file(tmp: Path) -> None:
    upstream = Upstream(password=OLD)
    await upstream.start()
    port = free_port()
    cfg, secret = rotating_config(tmp, upstream, listen=[{"address": f"127.0.0.1:{port}", "tls": "none"}])
    path = write_config(tmp / "smtpguard.yaml", cfg)
    log = tmp / "serve.log"
    guard = GuardProcess(path, log)
    guard.start()
    try:
        await guard.wait_port(port)
        started = asyncio.Event()
        sending = asyncio.create_task(flow(port, started, "hup"))
        await started.wait()
        secret.write_text(NEW + "\n")
        assert guard.proc is not None
        guard.proc.send_signal(signal.SIGHUP)
        # Off the loop: the upstream in this process keeps answering meanwhile.
        await asyncio.to_thread(wait_for_line, log, "provider password re-read")
        upstream.rotate(NEW)
        results = await sending
    finally:
        await guard.astop()
        await upstream.stop()
    assert_nothing_lost(results, upstream)
    # Read at the SIGHUP, so the provider never had to refuse the old one.
    assert upstream.auth_refused == 0 and upstream.auth_ok >= 2


async def test_a_535_with_the_file_unchanged_stands(tmp: Path) -> None:
    upstream = Upstream(password=NEW)
    await upstream.start()
    try:
        cfg, _ = rotating_config(tmp, upstream)
        async with running_guard(cfg) as guard:
            reply = await send(guard.ports[0], message("stale:1"))
    finally:
        await upstream.stop()
    # Nothing new to try: one refusal, no retry, nothing sent; the key stays retryable.
    assert reply.code == 451 and reply.text.startswith("4.4.1"), reply
    assert len(upstream.refused_connections) == 1 and upstream.received == []


# --- review findings ---------------------------------------------------------------------------
@pytest.mark.parametrize("rebuilt", [False, True], ids=["same-providers", "providers-rebuilt"])
async def test_file_first_with_reload_keeps_mail_flowing_before_the_provider_switches(
    tmp: Path, rebuilt: bool
) -> None:
    # The runbook's "file first (best)" order against a provider holding one password at a
    # time: the new secret is written and reloaded before the provider switches. Until it
    # does, the new secret is refused; the one in use before the reload still works and
    # must be tried once, or every fresh connection of that window is a 451 4.4.1 and the
    # provider's circuit opens.
    upstream = Upstream(password=OLD)
    await upstream.start()
    try:
        cfg, secret = rotating_config(tmp, upstream)
        cfg["providers"].append({"name": "standby", "kind": "maildir", "path": str(tmp / "standby")})
        async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
            port = guard.ports[0]
            secret.write_text(NEW + "\n")
            if rebuilt:
                # Another provider changes in the same reload: every provider is rebuilt,
                # and the primary's new object must still know the secret in use before.
                cfg["providers"][1]["path"] = str(tmp / "standby2")
                write_config(tmp / "smtpguard.yaml", cfg)
            assert await guard.reload()
            before = await send(port, message("ff:before-switch"))
            upstream.rotate(NEW)
            after = await send(port, message("ff:after-switch"))
    finally:
        await upstream.stop()
    assert before.code == 250 and after.code == 250, (before, after)
    # Both at the provider, none failed over to the standby's maildir.
    assert Counter(upstream.event_keys()) == {"ff:before-switch": 1, "ff:after-switch": 1}


async def test_the_prober_uses_the_password_a_535_made_smtpguard_read(tmp: Path) -> None:
    # Provider first, no reload: the 535 makes the relay read the file again. The readiness
    # prober must authenticate with that same secret, or it reports a provider that is
    # sending fine as not ready (smtpguard_provider_ready 0, the share routing off).
    upstream = Upstream(password=OLD)
    await upstream.start()
    try:
        cfg, secret = rotating_config(tmp, upstream)
        cfg["providers"][0]["probe_interval"] = "10s"
        async with running_guard(cfg) as guard:
            assert guard.prober is not None
            async with asyncio.timeout(10):
                while "primary" not in guard.prober.ready:
                    guard.prober.probed.clear()
                    await guard.prober.probed.wait()
            assert guard.prober.ready["primary"] is True
            upstream.rotate(NEW, then=lambda: secret.write_text(NEW + "\n"))
            reply = await send(guard.ports[0], message("probe:1"))
            assert reply.code == 250, reply
            probes = guard.prober.probes
            async with asyncio.timeout(20):
                while guard.prober.probes == probes:
                    guard.prober.probed.clear()
                    await guard.prober.probed.wait()
            ready = guard.prober.ready["primary"]
            rendered = guard.metrics.render().decode()
    finally:
        await upstream.stop()
    assert ready is True, guard.prober.detail
    assert 'smtpguard_provider_ready{provider="primary"} 1.0' in rendered
    assert upstream.event_keys() == ["probe:1"]


async def test_a_535_with_the_password_file_unreadable_says_so(
    tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = Upstream(password=NEW)
    await upstream.start()
    try:
        cfg, secret = rotating_config(tmp, upstream)
        async with running_guard(cfg) as guard:
            secret.unlink()
            reply = await send(guard.ports[0], message("gone:1"))
    finally:
        await upstream.stop()
    assert reply.code == 451 and reply.text.startswith("4.4.1"), reply
    assert upstream.received == []
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("smtpguard")]
    assert any("cannot read" in line and str(secret) in line for line in lines), lines
    # The secrets themselves are never logged.
    assert not any(OLD in line or NEW in line for line in lines), lines


async def test_a_wrong_password_costs_the_same_whoever_the_user(
    tmp: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failed AUTH must not tell an unknown user from a known one by its time: with one
    # user holding [new, old], a wrong password for that user costs two argon2
    # verifications, so every failure (any user, unknown ones too) must cost two. The real
    # hasher verifies; this only counts its calls.
    from smtpguard import passwords

    real = passwords._hasher
    calls: list[str] = []

    class Counting:
        def verify(self, h: str, p: str) -> bool:
            calls.append(h)
            return real.verify(h, p)

    cfg = base_config(tmp, upstream.port)
    cfg.setdefault("limits", {})["auth_failures"] = 50
    cfg["zones"]["acme"]["users"] = [
        {"username": "acme-app", "password_hashes": [password_hash("new-pass"), password_hash(PASSWORD)]},
        {"username": "acme-cron", "password_hash": password_hash(PASSWORD)},
    ]
    monkeypatch.setattr(passwords, "_hasher", Counting())
    costs: dict[str, int] = {}
    async with running_guard(cfg) as guard:
        for user in ("acme-app", "acme-cron", "nobody"):
            calls.clear()
            reply = await send(guard.ports[0], message(f"cost:{user}"), user=user, password="wrong")
            assert reply.code == 535, reply
            costs[user] = len(calls)
        calls.clear()
        ok = await send(guard.ports[0], message("cost:ok"), user="acme-cron")
    assert ok.code == 250, ok
    assert costs["acme-app"] == costs["acme-cron"] == costs["nobody"] > 0, costs
    assert upstream.event_keys() == ["cost:ok"]


async def test_a_reload_with_the_password_file_unreadable_keeps_the_running_password(
    tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = Upstream(password=OLD)
    await upstream.start()
    try:
        cfg, secret = rotating_config(tmp, upstream)
        async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
            secret.unlink()
            assert await guard.reload() is False
            reply = await send(guard.ports[0], message("unreadable:1"))
    finally:
        await upstream.stop()
    assert reply.code == 250, reply
    assert upstream.event_keys() == ["unreadable:1"]
    refused = [r for r in caplog.records if r.getMessage().startswith("reload refused")]
    assert refused and any(str(secret) in p for p in refused[0].__dict__["problems"]), refused


async def test_a_cached_success_of_the_old_password_ends_when_its_hash_is_removed(
    tmp: Path, upstream: Upstream
) -> None:
    cfg = base_config(tmp, upstream.port)
    new_hash = password_hash("new-pass")
    cfg["zones"]["acme"]["users"] = [
        {"username": "acme-app", "password_hashes": [new_hash, password_hash(PASSWORD)]}
    ]
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        port = guard.ports[0]
        # Twice: the second is answered from the verification cache.
        first = await send(port, message("cache:1"), password=PASSWORD)
        cached = await send(port, message("cache:2"), password=PASSWORD)
        cfg["zones"]["acme"]["users"] = [{"username": "acme-app", "password_hash": new_hash}]
        write_config(tmp / "smtpguard.yaml", cfg)
        assert await guard.reload()
        removed = await send(port, message("cache:3"), password=PASSWORD)
        new = await send(port, message("cache:4"), password="new-pass")
    assert first.code == cached.code == new.code == 250, (first, cached, new)
    assert removed.code == 535 and removed.text.startswith("5.7.8"), removed
    assert sorted(k or "" for k in upstream.event_keys()) == ["cache:1", "cache:2", "cache:4"]
