"""Upstream resilience: failover, circuit breaker, unknown outcomes, partial recipients,
provider-side idempotency, operator tools. Real upstreams: aiosmtpd recorders and Postfix's
smtp-sink with its fault flags."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.smtp import SMTP, AuthResult

from smtpguard.cli import main
from tests.support import (
    Behaviour,
    FakeClock,
    SmtpSink,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)


def smtp_provider(name: str, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "smtp",
        "host": "127.0.0.1",
        "port": port,
        "tls": "none",
        "timeouts": {"connect": "2s", "command": "3s", "data": "1s"},
        "pool_size": 4,
        **extra,
    }


def routed(tmp: Path, *providers: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    cfg = base_config(tmp, None, **overrides)
    cfg["providers"] = list(providers)
    return cfg


@contextlib.asynccontextmanager
async def upstream_on(port: int | None = None) -> AsyncIterator[Upstream]:
    up = Upstream(port)
    await up.start()
    try:
        yield up
    finally:
        await up.stop()


class Busy421:
    """A provider that answers every connection with 421 and hangs up; counts connections."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        async def greet(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            w.write(b"421 4.3.2 Service not available, closing channel\r\n")
            await w.drain()
            w.close()

        self._server = await asyncio.start_server(greet, "127.0.0.1", self.port, reuse_address=True)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


async def test_primary_refused_standby_delivers(tmp: Path, upstream: Upstream) -> None:
    cfg = routed(tmp, smtp_provider("primary", free_port()), smtp_provider("standby", upstream.port))
    path = write_config(tmp / "c.yaml", cfg)
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("f1"))
    assert reply.code == 250 and "queued as Q1" in reply.text
    assert upstream.event_keys() == ["f1"]
    assert await asyncio.to_thread(main, ["history", "acme", "f1", "-c", str(path)]) == 0


async def test_hang_after_dot_is_never_failed_over(tmp: Path, upstream: Upstream) -> None:
    async with upstream_on() as standby:
        upstream.handler.default = Behaviour(hang_after_dot=5)
        cfg = routed(tmp, smtp_provider("primary", upstream.port), smtp_provider("standby", standby.port))
        async with running_guard(cfg) as guard:
            first = await send(guard.ports[0], message("u1"))
            retry = await send(guard.ports[0], message("u1"))
        assert first.code == 451 and "unknown" in first.text
        assert retry.code == 451 and retry.text.startswith("4.3.0") and "held" in retry.text
        assert len(upstream.received) == 1 and upstream.handler.transactions == 1
        assert standby.received == []


async def test_421_throttles_the_provider_instead_of_opening_its_circuit(
    tmp: Path, upstream: Upstream
) -> None:
    """DESIGN.md §16: a 421 is the provider asking for less traffic. It is skipped for its
    throttle_backoff (every message fails over before DATA) and its circuit stays closed;
    after the backoff it is used again without a half-open probe."""
    primary_port = free_port()
    busy = Busy421(primary_port)
    await busy.start()
    clock = FakeClock()
    primary = {**smtp_provider("primary", primary_port), "throttle_backoff": "60s"}
    cfg = routed(
        tmp,
        primary,
        smtp_provider("standby", upstream.port),
        breaker={"failure_threshold": 1, "cooldown": "30s"},
    )
    async with running_guard(cfg, clock=clock) as guard:
        port = guard.ports[0]
        for i in range(5):
            assert (await send(port, message(f"c{i}"))).code == 250
        assert busy.connections == 1  # throttled: not contacted again during the backoff
        assert guard.route is not None and guard.route.circuits()["primary"] == "closed"
        assert len(upstream.received) == 5
        await busy.stop()
        async with upstream_on(primary_port) as recovered:
            clock.t += 61
            assert (await send(port, message("c5"))).code == 250
            assert (await send(port, message("c6"))).code == 250
            assert recovered.event_keys() == ["c5", "c6"]
        assert guard.route.circuits()["primary"] == "closed"
    assert len(upstream.received) == 5


async def test_half_open_probe_failure_reopens(tmp: Path, upstream: Upstream) -> None:
    clock = FakeClock()
    dead = free_port()
    cfg = routed(
        tmp,
        smtp_provider("primary", dead),
        smtp_provider("standby", upstream.port),
        breaker={"failure_threshold": 1, "cooldown": "10s"},
    )
    async with running_guard(cfg, clock=clock) as guard:
        assert (await send(guard.ports[0], message("h1"))).code == 250
        assert guard.route is not None and guard.route.circuits()["primary"] == "open"
        clock.t += 11
        assert (await send(guard.ports[0], message("h2"))).code == 250
        assert guard.route.circuits()["primary"] == "open"
    assert upstream.event_keys() == ["h1", "h2"]


async def test_all_providers_down_then_delivered_once_after_recovery(tmp: Path) -> None:
    p1, p2 = free_port(), free_port()
    cfg = routed(tmp, smtp_provider("primary", p1), smtp_provider("standby", p2))
    async with running_guard(cfg) as guard:
        down = await send(guard.ports[0], message("d1"))
        assert down.code == 451 and down.text.startswith("4.4.1")
        async with upstream_on(p1) as primary:
            up = await send(guard.ports[0], message("d1"))
            again = await send(guard.ports[0], message("d1"))
        assert up.code == 250 and "duplicate" not in up.text
        assert again.code == 250 and "duplicate" in again.text
        assert primary.event_keys() == ["d1"]


async def test_partial_recipients_delivered_and_bounced_suppressed(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.default = Behaviour(rcpt={"gone@example.com": "550 5.1.1 no such user"})
    cfg = base_config(tmp, upstream.port)
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("p1"), recipients=["ok@example.com", "gone@example.com"])
        assert reply.code == 250 and "refused <gone@example.com> 550" in reply.text
        assert upstream.received[0].rcpt_tos == ["ok@example.com"]
        assert guard.store is not None
        assert await guard.store.suppressed("acme", "gone@EXAMPLE.com") == "acme"
        later = await send(
            guard.ports[0], message("p2", to="gone@example.com"), recipients=["gone@example.com"]
        )
        assert later.code == 550 and later.text.startswith("5.1.1") and "acme" in later.text
    assert len(upstream.received) == 1


async def test_idempotent_provider_retries_unknown_once(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.script = [Behaviour(drop_after_dot=True)]
    cfg = routed(tmp, smtp_provider("primary", upstream.port, idempotency_header="Resend-Idempotency-Key"))
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("i1"))
    assert reply.code == 250
    assert len(upstream.received) == 2
    assert {r.header("Resend-Idempotency-Key") for r in upstream.received} == {"acme:i1"}


async def test_non_idempotent_provider_keeps_unknown(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.script = [Behaviour(drop_after_dot=True)]
    cfg = routed(tmp, smtp_provider("primary", upstream.port))
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("i2"))
    assert reply.code == 451 and "unknown" in reply.text
    assert len(upstream.received) == 1 and upstream.received[0].header("Resend-Idempotency-Key") is None


async def test_upstream_535_trips_circuit_and_logs_without_secret(
    tmp: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PRIMARY_PASSWORD", "provider-secret-XYZ")
    port = free_port()
    loop = asyncio.get_running_loop()

    def refuse(*_: Any) -> AuthResult:
        return AuthResult(success=False, handled=False)

    server = await loop.create_server(
        lambda: SMTP(upstream.handler, authenticator=refuse, auth_require_tls=False),
        "127.0.0.1",
        port,
    )
    try:
        cfg = routed(
            tmp,
            smtp_provider("primary", port, username="relay", password_env="PRIMARY_PASSWORD"),
            smtp_provider("standby", upstream.port),
        )
        caplog.set_level(logging.DEBUG)
        async with running_guard(cfg) as guard:
            reply = await send(guard.ports[0], message("a1"))
            assert guard.route is not None and guard.route.circuits()["primary"] == "open"
    finally:
        server.close()
    assert reply.code == 250 and upstream.event_keys() == ["a1"]
    critical = [r for r in caplog.records if r.levelno >= logging.CRITICAL]
    assert critical and "credentials" in critical[0].getMessage()
    assert "provider-secret-XYZ" not in caplog.text


# --- Postfix smtp-sink fault flags -----------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "first_code", "first_enhanced", "standby_gets", "retry_code"),
    [
        (("-r", "MAIL"), 250, "2.0.0", 1, 250),  # 4xx at MAIL: nothing accepted, standby
        (("-Q", "RCPT"), 250, "2.0.0", 1, 250),  # 421 before the dot: standby
        (("-r", "DATA"), 250, "2.0.0", 1, 250),  # 4xx to DATA, no byte written: standby
        (("-f", "."), 500, "5.3.0", 0, 500),  # 5xx after the dot: failed, never retried
        (("-r", "."), 450, "4.3.0", 0, 451),  # 4xx after the dot: deferred, min interval
        (("-q", "."), 451, "4.3.0", 0, 451),  # hang up after the dot: unknown, held
    ],
)
async def test_smtp_sink_faults(
    tmp: Path,
    upstream: Upstream,
    flags: tuple[str, ...],
    first_code: int,
    first_enhanced: str,
    standby_gets: int,
    retry_code: int,
) -> None:
    sink = SmtpSink(tmp, *flags)
    sink.start()
    try:
        cfg = routed(tmp, smtp_provider("primary", sink.port), smtp_provider("standby", upstream.port))
        async with running_guard(cfg) as guard:
            first = await send(guard.ports[0], message("s1"))
            retry = await send(guard.ports[0], message("s1"))
        held = sink.event_keys()
    finally:
        sink.stop()
        sink.cleanup()
    assert first.code == first_code, first
    assert first.text.startswith(first_enhanced), first
    assert len(upstream.received) == standby_gets
    assert retry.code == retry_code, retry
    if standby_gets:
        assert "duplicate" in retry.text
    # Whatever the fault, the sink never holds the event twice.
    assert held.count("s1") <= 1


# --- operator tools --------------------------------------------------------------------------
async def test_resolve_and_release_are_audited_and_single_use(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream.handler.script = [Behaviour(drop_after_dot=True), Behaviour(data="554 5.7.1 policy")]
    cfg = base_config(tmp, upstream.port)
    path = write_config(tmp / "c.yaml", cfg)

    def cli(*args: str) -> int:
        return main([*args, "-c", str(path)])

    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        assert (await send(port, message("o1"))).code == 451  # unknown
        assert (await send(port, message("o2"))).code == 554  # failed
        assert await asyncio.to_thread(cli, "release", "acme", "o1") == 1
        assert "not failed" in capsys.readouterr().err
        assert await asyncio.to_thread(cli, "resolve", "acme", "o1", "--as", "retry") == 0
        assert await asyncio.to_thread(cli, "resolve", "acme", "o1", "--as", "retry") == 1
        assert "already resolved by cli:" in capsys.readouterr().err
        assert await asyncio.to_thread(cli, "release", "acme", "o2") == 0
        assert await asyncio.to_thread(cli, "release", "acme", "o2") == 1
        assert (await send(port, message("o1"))).code == 250
        assert (await send(port, message("o2"))).code == 250
        assert (await send(port, message("o2"))).text.find("duplicate") > 0
    assert await asyncio.to_thread(cli, "history", "acme", "o2", "--json") == 0
    out = capsys.readouterr().out
    assert '"action": "release"' in out and '"from_state": "failed"' in out
    # o1 was received by the upstream when it hung up, and again after the operator's retry;
    # o2 was refused once (554) and accepted once after release.
    assert upstream.event_keys().count("o2") == 1


async def test_idempotent_retry_refused_before_data_never_fails_over(tmp: Path, upstream: Upstream) -> None:
    async with upstream_on() as primary:
        # The primary takes the message and hangs up; the automatic retry is refused at MAIL
        # with a 421 — an answer that would fail over anywhere else.
        primary.handler.script = [Behaviour(drop_after_dot=True), Behaviour(mail="421 4.3.2 busy")]
        cfg = routed(
            tmp,
            smtp_provider("primary", primary.port, idempotency_header="X-Idem"),
            smtp_provider("standby", upstream.port),
        )
        async with running_guard(cfg) as guard:
            first = await send(guard.ports[0], message("n1"))
            again = await send(guard.ports[0], message("n1"))
        assert len(primary.received) == 1
    assert upstream.received == []  # never the standby: the first copy may be at the primary
    assert first.code == 451 and "unknown" in first.text
    assert again.code == 451 and again.text.startswith("4.3.0")


async def test_temporary_refusal_of_one_recipient_defers_the_whole_event(
    tmp: Path, upstream: Upstream
) -> None:
    upstream.handler.script = [Behaviour(rcpt={"later@example.com": "452 4.2.2 mailbox full"})]
    cfg = base_config(tmp, upstream.port, event_key={"min_retry_interval": "1s", "strip": False})
    clock = FakeClock()  # min_retry_interval is on smtpguard's clock
    async with running_guard(cfg, clock=clock) as guard:
        first = await send(guard.ports[0], message("t1"), recipients=["ok@example.com", "later@example.com"])
        assert first.code == 452 and first.text.startswith("4.2.2")
        assert upstream.received == []  # nobody got it, so nobody misses it
        clock.t += 1.1
        retry = await send(guard.ports[0], message("t1"), recipients=["ok@example.com", "later@example.com"])
    assert retry.code == 250
    assert [r.rcpt_tos for r in upstream.received] == [["ok@example.com", "later@example.com"]]


async def test_deferred_event_suppresses_nobody_so_its_retry_is_the_same_message(
    tmp: Path, upstream: Upstream
) -> None:
    upstream.handler.script = [
        Behaviour(
            rcpt={"gone@example.com": "550 5.1.1 no such user", "later@example.com": "452 4.2.2 mailbox full"}
        )
    ]
    cfg = base_config(tmp, upstream.port, event_key={"min_retry_interval": "1s", "strip": False})
    rcpts = ["gone@example.com", "later@example.com"]
    clock = FakeClock()  # min_retry_interval is on smtpguard's clock
    async with running_guard(cfg, clock=clock) as guard:
        first = await send(guard.ports[0], message("m1"), recipients=rcpts)
        assert first.code == 452
        assert guard.store is not None
        assert await guard.store.suppressed("acme", "gone@example.com") is None
        clock.t += 1.1
        retry = await send(guard.ports[0], message("m1"), recipients=rcpts)
    assert retry.code == 250 and "reused" not in retry.text
    assert [r.rcpt_tos for r in upstream.received] == [rcpts]


async def test_a_relay_longer_than_its_lease_keeps_it(tmp: Path, upstream: Upstream) -> None:
    """A provider that takes 2.5 s over a 1 s lease: the lease is renewed while the relay
    runs, so a duplicate arriving meanwhile waits (in_flight) instead of finding an expired
    lease, and the event ends delivered, sent once."""
    upstream.handler.default = Behaviour(hang_after_dot=2.5)
    cfg = base_config(tmp, upstream.port, event_key__lease="1s", event_key__inflight_wait="200ms")
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        first = asyncio.create_task(send(port, message("slow1")))
        await upstream.wait_received(1)
        duplicates = []
        # Past the 1 s lease and until the first send ends (how many fit depends on how
        # busy the machine is): every duplicate answered meanwhile waited, as in_flight.
        while not first.done():
            await asyncio.sleep(0.3)
            reply = await send(port, message("slow1"))
            # A `250 duplicate` means the first send had ended by then, whatever its client
            # task knows yet; the upstream count below says nothing went twice.
            if not first.done() and not (reply.code == 250 and "duplicate" in reply.text):
                duplicates.append(reply)
        assert (await first).code == 250
        assert guard.store is not None
        record = await guard.store.get("acme", "slow1")
    assert len(duplicates) >= 2
    assert [(r.code, r.text.split(" ", 1)[0]) for r in duplicates] == [(451, "4.7.1")] * len(duplicates)
    assert record is not None and record.state.value == "delivered"
    assert upstream.handler.transactions == 1


@pytest.mark.parametrize(
    ("behaviour", "phase"),
    [
        pytest.param(
            Behaviour(rcpt={"customer@example.com": "550 5.1.1 no such user"}), "before_data", id="rcpt"
        ),
        pytest.param(Behaviour(mail="553 5.7.1 sender refused"), "before_data", id="mail"),
        pytest.param(Behaviour(data="554 5.6.0 content refused"), "data_sent", id="data"),
    ],
)
async def test_history_records_the_phase_the_attempt_reached(
    tmp: Path, upstream: Upstream, behaviour: Behaviour, phase: str
) -> None:
    """data_sent is noted while MAIL and RCPT go out; a refusal there still reads, in the
    history operators use to resolve, as an attempt that never reached DATA."""
    upstream.handler.default = behaviour
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        reply = await send(guard.ports[0], message("phase1"))
        assert guard.store is not None
        record = await guard.store.get("acme", "phase1")
    assert reply.code >= 500
    assert record is not None and record.state.value == "failed"
    assert [a.phase for a in record.attempts] == [phase]
    # One transaction, refused where the behaviour says: nothing accepted, nothing retried.
    assert upstream.handler.transactions == 1 and upstream.received == []
