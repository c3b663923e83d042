"""Provider throttling end to end (DESIGN.md §16): real clients, real smtpguard, counting
upstreams that rate-limit like a provider does.

What each test counts at the upstream: the MAIL commands it answered 250 (their times), the
ones it refused as rate-limited, the messages it recorded (each event key exactly once), and
the most sessions it had open at once.

Window tolerance: smtpguard hands out send slots 1/max_rate apart (a GCRA in the store), so
any closed one-second window holds at most max_rate + 1 slot instants (both ends). The
upstream timestamps the MAIL command, a few milliseconds after the slot, so jitter can move
a slot across a window edge, never add one; max_rate + 1 per window is the bound asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard.cli import main
from smtpguard.policy.breaker import Circuit
from tests.support import (
    Behaviour,
    FakeClock,
    GuardProcess,
    RateLimit,
    RedisServer,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
    settled_records,
    write_config,
)
from tests.support.eventually import eventually


def provider(name: str, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "smtp",
        "host": "127.0.0.1",
        "port": port,
        "tls": "none",
        "timeouts": {"connect": "2s", "command": "3s", "data": "3s"},
        "pool_size": 4,
        **extra,
    }


def most_in_a_second(times: list[float]) -> int:
    return max((sum(1 for t in times if start <= t <= start + 1.0) for start in times), default=0)


@contextlib.asynccontextmanager
async def upstream_at(port: int | None = None) -> AsyncIterator[Upstream]:
    up = Upstream(port)
    await up.start()
    try:
        yield up
    finally:
        await up.stop()


QUEUE = {"backoff": {"base": "100ms", "max": "500ms"}, "workers": 4, "poll_interval": "100ms"}


async def test_a_throttling_upstream_gets_max_rate_and_nothing_during_the_backoff(
    tmp: Path, upstream: Upstream
) -> None:
    """Queue mode: the upstream answers `421 4.7.0 rate limited` for one 1 s window, after 6 messages.
    smtpguard stays off it for throttle_backoff, then sends at no more than max_rate; every
    message is delivered once, the throttled one without an attempt counted, and the circuit
    never opened."""
    upstream.handler.rate_limit = RateLimit(after=6, window=1.0, times=1)
    cfg = base_config(
        tmp,
        None,
        zones__acme__delivery="queue",
        zones__acme__hourly_cap=10_000,
        zones__acme__monthly_cap=100_000,
    )
    cfg["providers"] = [provider("primary", upstream.port, max_rate="5/s", throttle_backoff="2s")]
    cfg["breaker"] = {"failure_threshold": 1, "cooldown": "60s"}
    cfg["queue"] = QUEUE
    keys = [f"t{i}" for i in range(18)]
    async with running_guard(cfg) as guard:
        replies = await asyncio.gather(*(send(guard.ports[0], message(k)) for k in keys))
        assert [r.code for r in replies] == [250] * len(keys)
        await upstream.wait_received(len(keys), timeout=15)
        records = await settled_records(cfg["store"]["url"], "acme", keys)
        assert guard.route is not None
        circuit = guard.route.circuits()["primary"]
        metrics = guard.metrics.render().decode()
    h = upstream.handler
    assert Counter(upstream.event_keys()) == dict.fromkeys(keys, 1)  # 0 lost, 0 duplicates
    # smtpguard did not hammer it: only transactions already under way when the first 421
    # came (one per worker at most, on a loaded machine) met the provider's window.
    limited = h.limited_times[0]
    assert len(h.limited_times) <= 4 and h.limited_times[-1] - limited < 0.5, h.limited_times
    assert [t for t in h.mail_times if limited < t < limited + 2.0] == []  # throttle_backoff
    assert len([t for t in h.mail_times if t > limited]) == len(keys) - 6
    assert most_in_a_second(h.mail_times) <= 5 + 1
    # The throttled message waited unattempted: one attempt each, all delivered.
    assert all(r is not None and r.state.value == "delivered" for r in records.values())
    assert sorted(len(r.attempts) for r in records.values() if r) == [1] * len(keys)
    assert circuit is Circuit.CLOSED
    assert 'smtpguard_breaker_state{provider="primary"} 0.0' in metrics
    assert 'smtpguard_provider_rate_limited_total{provider="primary"} 1.0' in metrics


async def test_relay_mode_fails_over_to_the_standby_before_data_while_the_primary_is_throttled(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with upstream_at() as primary, upstream_at() as standby:
        primary.handler.default = Behaviour(mail="421 4.7.0 rate limited, slow down")
        cfg = base_config(tmp, None)
        cfg["providers"] = [
            provider("primary", primary.port, throttle_backoff="60s"),
            provider("standby", standby.port),
        ]
        cfg["breaker"] = {"failure_threshold": 1, "cooldown": "60s"}
        path = write_config(tmp / "c.yaml", cfg)
        async with running_guard(cfg) as guard:
            for i in range(4):
                reply = await send(guard.ports[0], message(f"f{i}"))
                assert reply.code == 250, reply
            assert guard.route is not None
            assert guard.route.circuits()["primary"] is Circuit.CLOSED
            metrics = guard.metrics.render().decode()
            code = await asyncio.to_thread(main, ["stats", "--json", "-c", str(path)])
            stats = json.loads(capsys.readouterr().out)
    # One MAIL reached the throttled primary; every message went to the standby, once.
    assert primary.handler.transactions == 1 and primary.received == []
    assert standby.event_keys() == ["f0", "f1", "f2", "f3"]
    assert 'smtpguard_provider_throttled{provider="primary"} 1.0' in metrics
    assert 'smtpguard_provider_throttled{provider="standby"} 0.0' in metrics
    # Every instance (and the operator) sees it in the store.
    assert code == 0 and list(stats["throttled"]) == ["primary"]


async def test_relay_mode_without_a_standby_answers_451_441_then_a_retry_after_the_backoff_sends_once(
    tmp: Path, upstream: Upstream
) -> None:
    upstream.handler.script = [Behaviour(mail="451 4.7.0 Too many messages, slow down")]
    cfg = base_config(tmp, None)
    cfg["providers"] = [provider("primary", upstream.port, throttle_backoff="1s")]
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        port = guard.ports[0]
        first = await send(port, message("once"))
        assert (first.code, first.text[:5]) == (451, "4.4.1")
        again = await send(port, message("once"))  # during the backoff: not even tried
        assert (again.code, again.text[:5]) == (451, "4.4.1")
        assert upstream.handler.transactions == 1
        clock.t += 1.1  # past the backoff
        assert (await send(port, message("once"))).code == 250
        dup = await send(port, message("once"))
        assert dup.code == 250 and "duplicate" in dup.text
        assert guard.route is not None and guard.route.circuits()["primary"] is Circuit.CLOSED
    assert upstream.event_keys() == ["once"]
    assert upstream.handler.transactions == 2


async def test_a_421_after_the_dot_is_never_failed_over_and_throttles_the_next_messages(
    tmp: Path,
) -> None:
    """After the final dot the reply is the message's outcome (DESIGN.md §4): deferred, not
    sent to the standby. It still throttles the primary, so the next message goes to the
    standby before DATA."""
    async with upstream_at() as primary, upstream_at() as standby:
        primary.handler.script = [Behaviour(data="421 4.7.0 rate limited")]
        cfg = base_config(tmp, None)
        cfg["providers"] = [
            provider("primary", primary.port, throttle_backoff="60s"),
            provider("standby", standby.port),
        ]
        async with running_guard(cfg) as guard:
            port = guard.ports[0]
            dot = await send(port, message("after-dot"))
            # The provider's 421 closed its session, not the client's: the client hears 451
            # with the provider's enhanced code (policy/outcome.py client_reply).
            assert dot.code == 451 and dot.text.startswith("4.7.0"), dot
            assert standby.received == []
            assert (await send(port, message("next"))).code == 250
            assert guard.route is not None and guard.route.circuits()["primary"] is Circuit.CLOSED
    assert primary.handler.data_commands == 1 and primary.received == []
    assert standby.event_keys() == ["next"]


async def test_a_421_left_on_an_idle_pooled_connection_is_no_rate_limit(
    tmp: Path, upstream: Upstream
) -> None:
    """A provider ends an idle pooled session with `421 4.4.2 … timeout exceeded`; the next
    MAIL on it reads that line. That is the idle session's end, not a rate limit: the message
    goes out on a fresh connection and the provider is not throttled."""
    upstream.handler.script = [Behaviour(idle_421=True)]
    cfg = base_config(tmp, None)
    cfg["providers"] = [provider("primary", upstream.port, throttle_backoff="60s")]
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], message("idle1"))).code == 250
        assert (await send(guard.ports[0], message("idle2"))).code == 250
        metrics = guard.metrics.render().decode()
    assert upstream.event_keys() == ["idle1", "idle2"]
    assert upstream.handler.transactions == 3  # idle2: the stale session's MAIL, then a fresh one
    assert 'smtpguard_provider_throttled{provider="primary"} 0.0' in metrics
    assert 'smtpguard_provider_rate_limited_total{provider="primary"} 0.0' in metrics


# --- across instances on one redis-server ------------------------------------------------------
def _instances(
    tmp: Path, redis: RedisServer, upstream_port: int, delivery: str, **provider_extra: Any
) -> tuple[list[GuardProcess], list[int]]:
    guards, ports = [], []
    for i in range(2):
        port = free_port()
        cfg = base_config(
            tmp,
            None,
            zones__acme__hourly_cap=10_000,
            zones__acme__monthly_cap=100_000,
            zones__acme__delivery=delivery,
        )
        cfg["providers"] = [provider("primary", upstream_port, **provider_extra)]
        cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
        cfg["store"] = {"url": redis.url}
        cfg["instance"] = f"i{i}"
        cfg["queue"] = QUEUE
        path = write_config(tmp / f"i{i}.yaml", cfg)
        guards.append(GuardProcess(path, tmp / f"i{i}.log"))
        ports.append(port)
    return guards, ports


async def _client(port: int, keys: list[str]) -> None:
    """A client that retries a 4xx, as a legacy app's mail queue does (quickly, here)."""
    for key in keys:
        for _ in range(60):
            reply = await send(port, message(key))
            if reply.code == 250:
                break
            assert reply.code == 451 and reply.text.startswith("4.4.1"), reply
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"{key} never accepted")


@pytest.mark.slow
async def test_max_rate_is_shared_by_two_instances(tmp: Path, upstream: Upstream) -> None:
    """Relay mode, two serve processes on one redis-server, three clients on each: the
    upstream's busiest second holds at most max_rate (+1, see the module's note), and every
    message arrived once."""
    redis = RedisServer(tmp, durable=True)
    redis.start()
    guards, ports = _instances(tmp, redis, upstream.port, "relay", max_rate="4/s")
    try:
        for g, port in zip(guards, ports, strict=True):
            g.start()
            await g.wait_port(port)
        batches = [[f"{name}{c}-{i}" for i in range(4)] for name in ("a", "b") for c in range(3)]
        owners = [ports[0]] * 3 + [ports[1]] * 3
        await asyncio.gather(*(_client(p, keys) for p, keys in zip(owners, batches, strict=True)))
    finally:
        for g in guards:
            await g.astop()
        redis.stop()
    keys = [k for batch in batches for k in batch]
    assert Counter(upstream.event_keys()) == dict.fromkeys(keys, 1)
    busiest = most_in_a_second(upstream.handler.mail_times)
    assert 3 <= busiest <= 4 + 1  # at the limit, never over it


@pytest.mark.slow
async def test_max_connections_is_shared_by_two_instances(tmp: Path, upstream: Upstream) -> None:
    """Queue mode, two serve processes, four workers and a pool of four each, max_connections
    2: the upstream never has more than 2 sessions open, and every message arrives once."""
    upstream.handler.default = Behaviour(hang_after_dot=0.15)
    redis = RedisServer(tmp, durable=True)
    redis.start()
    guards, ports = _instances(tmp, redis, upstream.port, "queue", max_connections=2)
    keys = [f"c{i}" for i in range(24)]
    try:
        for g, port in zip(guards, ports, strict=True):
            g.start()
            await g.wait_port(port)
        replies = await asyncio.gather(*(send(ports[i % 2], message(k)) for i, k in enumerate(keys)))
        assert [r.code for r in replies] == [250] * len(keys)
        await upstream.wait_received(len(keys), timeout=30)
        await settled_records(redis.url, "acme", keys)
    finally:
        for g in guards:
            await g.astop()
        redis.stop()
    assert Counter(upstream.event_keys()) == dict.fromkeys(keys, 1)
    assert upstream.handler.max_sessions == 2


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("max_rate", "10", "is not a rate (use a number, a slash and s, m or h: 10/s, 600/m)"),
        ("max_rate", "10/d", "is not a rate"),
        ("max_rate", "0/s", "a rate must be more than zero"),
        ("max_rate", 10, "expected a rate such as 10/s, 600/m or 36000/h"),
        ("max_connections", 0, "must be at least 1, got 0"),
        ("throttle_backoff", "0s", "must be more than 0"),
    ],
)
def test_bad_throttling_settings_are_refused_with_their_path(
    tmp: Path, capsys: pytest.CaptureFixture[str], key: str, value: object, says: str
) -> None:
    cfg = base_config(tmp, 2525)
    cfg["providers"][0][key] = value
    path = write_config(tmp / "c.yaml", cfg)
    assert main(["check-config", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"providers[0].{key} (line " in err and says in err, err


async def test_a_pooled_connection_lost_before_mail_gives_its_max_connections_slot_back(
    tmp: Path, upstream: Upstream
) -> None:
    """max_connections 1: the pooled connection is reused just as the provider ended it
    (`421 4.4.2 … timeout exceeded` to MAIL). The message goes out on a fresh connection,
    which needs the one slot: the stale connection must have given it back — a slot kept
    (and renewed) by a connection already gone would keep the provider from this instance
    for good, every later message answered 451 4.4.1."""
    upstream.handler.script = [Behaviour(idle_421=True)]
    cfg = base_config(tmp, None)
    cfg["providers"] = [provider("primary", upstream.port, max_connections=1)]
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        assert (await send(port, message("slot1"))).code == 250
        reply = await send(port, message("slot2"))
        assert reply.code == 250, reply
        # The idle connection closes (IDLE_HOLD, on the pool's own timer) and gives its slot back.
        open_now = await eventually(
            lambda: upstream.handler.open_sessions, lambda n: n == 0, timeout=10, interval=0.05
        )
        assert open_now == 0
        reply = await send(port, message("slot3"))
        assert reply.code == 250, reply
        store = guard.store
        assert store is not None
        # Once nothing is open any more, no slot is left held in the store.
        taken = await eventually(
            lambda: store.hold_connection("primary", "probe", 1, guard.clock() + 5, guard.clock()),
            timeout=10,
            interval=0.1,
        )
        assert taken
    assert upstream.event_keys() == ["slot1", "slot2", "slot3"]
    assert upstream.handler.max_sessions == 1


async def test_a_reload_keeps_max_connections_for_the_sessions_still_sending(tmp: Path) -> None:
    """max_connections 1 and a provider that takes 1.5 s to answer the dot. A reload that
    rebuilds the pools comes while a message is on the old pool's connection; the next
    message must wait for that connection's slot, not open a second session (the old pool
    gave every slot back at once, and the new pool's first slot had the same holder id as
    the old one's, so it "renewed" a slot that was another connection's)."""
    async with upstream_at() as up:
        up.handler.default = Behaviour(hang_after_dot=1.5)
        cfg = base_config(tmp, None)
        cfg["providers"] = [provider("primary", up.port, max_connections=1)]
        path = tmp / "c.yaml"
        async with running_guard(cfg, config_path=path) as guard:
            port = guard.ports[0]
            first = asyncio.create_task(send(port, message("old-pool")))
            await up.wait_received(1)  # its dot is in, its reply 1.5 s away
            cfg["providers"][0]["pool_size"] = 3  # a provider change: the pools are rebuilt
            write_config(path, cfg)
            assert await guard.reload()
            second = await send(port, message("new-pool"))
            assert (await first).code == 250
            assert second.code in (250, 451), second
            if second.code == 451:
                assert second.text.startswith("4.4.1"), second
                assert (await send(port, message("new-pool"))).code == 250
    assert up.event_keys() == ["old-pool", "new-pool"]
    assert up.handler.max_sessions == 1


async def test_a_send_cancelled_during_data_gives_its_connection_slot_back(
    tmp: Path, upstream: Upstream
) -> None:
    """A send cancelled while it waits for the reply to its dot (a drain that timed out, a
    delivery stopped at shutdown) closes its connection and gives its max_connections slot
    back at once, instead of leaving it renewed by this instance while nothing uses it."""
    import time

    import yaml

    from smtpguard.config import SmtpProviderConfig, loads
    from smtpguard.provider_gate import ConnectionSlots
    from smtpguard.relay import Envelope, SmtpProvider
    from smtpguard.store import store_from_url

    upstream.handler.default = Behaviour(hang_after_dot=5.0)
    cfg = base_config(tmp, None)
    cfg["providers"] = [provider("primary", upstream.port, max_connections=1)]
    pcfg = loads(yaml.safe_dump(cfg)).providers[0]
    assert isinstance(pcfg, SmtpProviderConfig)
    store = store_from_url(cfg["store"]["url"])
    await store.open()
    p = SmtpProvider(pcfg, None, "guard.test")
    p.limit_connections(ConnectionSlots(store, "primary", 1, "i0", time.time))

    async def marked() -> None:
        return None

    env = Envelope("acme", "k1", "a1", "billing@acme.example", ("customer@example.com",), b"x\r\n")
    try:
        task = asyncio.create_task(p.send(env, marked))
        await upstream.wait_received(1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # The cancelled send's slot comes back: another holder can take it.
        taken = await eventually(
            lambda: store.hold_connection("primary", "someone-else", 1, time.time() + 5, time.time()),
            timeout=5,
            interval=0.05,
        )
        assert taken
    finally:
        await p.close()
        await store.close()


async def test_a_421_to_ehlo_throttles_the_provider_and_is_not_a_helo_fallback(tmp: Path) -> None:
    """A provider that answers EHLO with `421 4.7.0 too many connections` (and closes) is
    asking for less traffic: the provider is throttled, its circuit untouched. (EHLO's
    failure used to send HELO on the closed connection, and the disconnect that followed
    counted against the circuit as a provider failure.)"""
    from tests.support import RecordingHandler

    class BusyAtEhlo(RecordingHandler):
        ehlos = 0

        async def handle_EHLO(
            self, server: Any, session: Any, envelope: Any, hostname: str, responses: list[str]
        ) -> list[str]:
            self.ehlos += 1
            if self.ehlos == 1:
                return ["421 4.7.0 too many connections, slow down"]
            session.host_name = hostname
            return responses

    async with upstream_at() as up:
        up.handler = BusyAtEhlo()
        cfg = base_config(tmp, None)
        cfg["providers"] = [provider("primary", up.port, throttle_backoff="1s")]
        cfg["breaker"] = {"failure_threshold": 1, "cooldown": "60s"}
        clock = FakeClock()
        async with running_guard(cfg, clock=clock) as guard:
            port = guard.ports[0]
            first = await send(port, message("e1"))
            assert (first.code, first.text[:5]) == (451, "4.4.1"), first
            assert guard.route is not None
            circuit = guard.route.circuits()["primary"]
            metrics = guard.metrics.render().decode()
            clock.t += 1.1  # past the backoff
            assert (await send(port, message("e1"))).code == 250
    assert circuit is Circuit.CLOSED
    assert 'smtpguard_provider_rate_limited_total{provider="primary"} 1.0' in metrics
    assert up.event_keys() == ["e1"]


async def test_a_queued_message_held_by_a_throttle_expires_at_its_max_age(tmp: Path) -> None:
    """Queue mode, class otp (max_age 2 s), a provider that answers MAIL with a rate limit and
    a throttle_backoff of 30 s: the entry is held for the throttle, but not past its
    max_age — it is expired (and never sent) about 2 s after acceptance, not 30 s later."""
    async with upstream_at() as up:
        up.handler.default = Behaviour(mail="421 4.7.0 rate limited")
        cfg = base_config(
            tmp,
            None,
            zones__acme__delivery="queue",
            zones__acme__hourly_cap=10_000,
            zones__acme__monthly_cap=100_000,
        )
        cfg["providers"] = [provider("primary", up.port, throttle_backoff="30s")]
        cfg["queue"] = {
            **QUEUE,
            "classes": {"otp": {"max_age": "2s", "priority": 0}, "bulk": {"max_age": "1d", "priority": 1}},
            "default_class": "bulk",
        }
        async with running_guard(cfg) as guard:
            reply = await send(guard.ports[0], message("otp-held", headers={"X-Message-Class": "otp"}))
            assert reply.code == 250, reply
            assert guard.store is not None
            store = guard.store

            async def state_now() -> str | None:
                rec = await store.get("acme", "otp-held")
                return rec.state.value if rec else None

            state = await eventually(state_now, lambda s: s == "expired", timeout=6, interval=0.1)
    assert state == "expired"
    assert up.handler.transactions == 1 and up.received == []
