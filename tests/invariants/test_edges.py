"""The promise at its edges (DESIGN.md §11): what changes between two attempts — a window
that ends, a zone that switches delivery mode, a class that goes away, a reply that is lost,
a clock that is off, an operator who decides while the owner may still be sending — never
makes a second upstream 250 and never strands a client-visible 250.

Each test reproduces one defect end to end: a real client, smtpguard in this process or as
`smtpguard serve`, a real recording upstream counting what it received, a real SQLite file or
redis-server. Time is faked only where a window must pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from smtpguard.cli import main
from smtpguard.policy.ledger import Record, State
from smtpguard.policy.limits import month_of
from smtpguard.server import Server
from smtpguard.store import Store, StoreUnavailable
from tests.support import (
    Behaviour,
    FakeClock,
    GuardProcess,
    LostReplyProxy,
    RedisServer,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.eventually import eventually


@pytest.fixture(params=["sqlite", "redis"])
async def store_url(request: pytest.FixtureRequest, tmp: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp / 'state.db'}"
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    plain = aioredis.Redis.from_url(server.url)
    await plain.flushall()
    await plain.aclose()
    yield server.url


def config(tmp: Path, upstream: Upstream, store_url: str, **overrides: Any) -> dict[str, Any]:
    cfg = base_config(tmp, upstream.port, **overrides)
    # The session's redis-server does not fsync (fast tests); serve refuses that unless told.
    cfg["store"] = {"url": store_url, **({"unsafe": True} if store_url.startswith("redis") else {})}
    cfg["queue"] = {"poll_interval": "100ms", "backoff": {"base": "1s", "max": "2s"}}
    return cfg


async def record(guard: Server, key: str, zone: str = "acme") -> Record:
    assert guard.store is not None
    rec = await guard.store.get(zone, key)
    assert rec is not None, f"no record for {key}"
    return rec


async def until_state(
    store: Store, key: str, state: State, timeout: float = 10, zone: str = "acme"
) -> Record:
    rec = await eventually(
        lambda: store.get(zone, key),
        lambda r: r is not None and r.state is state,
        timeout=timeout,
        interval=0.05,
    )
    if rec is not None and rec.state is state:
        return rec
    raise AssertionError(f"{key} is {rec.state.value if rec else 'missing'}, not {state.value}")


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


# --- 1. derive_window never replaces a held event ---------------------------------------------
@pytest.mark.parametrize("held", ["unknown", "failed"])
async def test_derive_mode_never_resends_a_held_event_after_its_window(
    tmp: Path, upstream: Upstream, store_url: str, held: str
) -> None:
    first_try = Behaviour(drop_after_dot=True) if held == "unknown" else Behaviour(data="554 5.7.1 refused")
    upstream.handler.script = [first_try]
    cfg = config(
        tmp, upstream, store_url, zones__acme__missing_key="derive", zones__acme__derive_window="10s"
    )
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        port = guard.ports[0]
        first = await send(port, message(None))
        clock.t += 11  # the window is over: a new submission of the same message
        retry = await send(port, message(None))
        again = await send(port, message(None))
    if held == "unknown":
        assert first.code == 451 and "unknown" in first.text
        assert retry.code == again.code == 451 and retry.text.startswith("4.3.0") and "held" in retry.text
    else:
        assert first.code == 554
        assert (retry.code, retry.text.split()[0]) == (554, "5.7.1")
    # Counted at the upstream: the first transaction only.
    assert upstream.handler.data_commands == 1


async def test_derive_mode_keeps_the_replaced_events_history(
    tmp: Path, upstream: Upstream, store_url: str
) -> None:
    cfg = config(
        tmp, upstream, store_url, zones__acme__missing_key="derive", zones__acme__derive_window="10s"
    )
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        port = guard.ports[0]
        assert (await send(port, message(None))).code == 250
        clock.t += 11
        assert (await send(port, message(None))).code == 250  # a new event by design
        assert guard.store is not None
        rec = await _only_record(guard.store)
    assert len(upstream.received) == 2
    assert [a.outcome for a in rec.attempts] == ["delivered", "delivered"]
    assert rec.audit[-1].action == "new_event"


async def _only_record(store: Store) -> Record:
    # A derived key is auto: + the fingerprint; list it through the store's own listing.
    (key,) = await _keys(store, "acme")
    rec = await store.get("acme", key)
    assert rec is not None and key.startswith("auto:")
    return rec


async def _keys(store: Store, zone: str) -> list[str]:
    from smtpguard.store.redis import RedisStore
    from smtpguard.store.sqlite import SQLiteStore

    if isinstance(store, SQLiteStore):
        return await store._read(
            lambda c: [k for (k,) in c.execute("SELECT key FROM events WHERE zone = ?", (zone,))]
        )
    assert isinstance(store, RedisStore)
    return [str(k) for k in await store._r.zrange(f"sg:{{{zone}}}:idx", 0, -1)]


# --- 2. a relay-mode retry after the zone moved to queue mode -----------------------------------
async def test_relay_deferred_event_retried_after_switch_to_queue_is_delivered(
    tmp: Path, upstream: Upstream, store_url: str
) -> None:
    upstream.handler.script = [Behaviour(data="451 4.3.0 try later")]
    cfg = config(tmp, upstream, store_url)
    clock = FakeClock()
    async with running_guard(cfg, clock=clock, config_path=tmp / "c.yaml") as guard:
        port = guard.ports[0]
        first = await send(port, message("inv:1"))
        assert first.code == 451 and first.text.startswith("4.3.0")
        cfg["zones"]["acme"]["delivery"] = "queue"
        write_config(tmp / "c.yaml", cfg)
        await guard.reload()
        clock.t += 61  # past min_retry_interval
        retry = await send(port, message("inv:1"))
        assert retry.code == 250 and "queued as" in retry.text
        assert guard.store is not None
        rec = await until_state(guard.store, "inv:1", State.DELIVERED)
        dup = await send(port, message("inv:1"))
    assert rec.lane == "transactional" and rec.queue_id is not None
    assert dup.code == 250 and "duplicate" in dup.text
    assert upstream.event_keys() == ["inv:1"]


# --- 3. queued mail is delivered whatever the zones' mode now -----------------------------------
@pytest.mark.parametrize("change", ["zone back to relay", "class removed"])
async def test_queued_entries_are_delivered_after_restart_with_changed_config(
    tmp: Path, upstream: Upstream, store_url: str, change: str
) -> None:
    cfg = config(tmp, upstream, store_url, zones__acme__delivery="queue")
    cfg["queue"]["classes"] = {
        "otp": {"max_age": "10m", "priority": 0},
        "bulk": {"max_age": "1d", "priority": 2},
    }
    cfg["queue"]["default_class"] = "otp"
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        await guard.store.set_paused("acme", True)  # hold the lane: nothing goes out yet
        for i in range(3):
            reply = await send(guard.ports[0], message(f"news:{i}", headers={"X-Message-Class": "bulk"}))
            assert reply.code == 250 and "queued" in reply.text
    assert upstream.received == []
    if change == "zone back to relay":
        cfg["zones"]["acme"]["delivery"] = "relay"
    else:
        del cfg["queue"]["classes"]["bulk"]
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        await guard.store.set_paused("acme", False)
        for i in range(3):
            await until_state(guard.store, f"news:{i}", State.DELIVERED)
        dup = await send(guard.ports[0], message("news:0", headers={"X-Message-Class": "otp"}))
    assert sorted(upstream.event_keys()) == ["news:0", "news:1", "news:2"]
    assert dup.code == 250 and "duplicate" in dup.text


# --- 5. a retried store write recognises its own earlier write ----------------------------------
@pytest.fixture
async def lossy_redis(redis_server: RedisServer) -> AsyncIterator[LostReplyProxy]:
    plain = aioredis.Redis.from_url(redis_server.url)
    await plain.flushall()
    await plain.aclose()
    proxy = LostReplyProxy(redis_server.port)
    await proxy.start()
    yield proxy
    await proxy.stop()


@pytest.mark.parametrize("delivery", ["relay", "queue"])
async def test_every_ledger_write_losing_its_reply_once_still_sends_once(
    tmp: Path, upstream: Upstream, lossy_redis: LostReplyProxy, delivery: str
) -> None:
    cfg = config(tmp, upstream, lossy_redis.url, zones__acme__delivery=delivery)
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        lossy_redis.lose(b"EVALSHA", times=1000, each_once=True)
        reply = await send(guard.ports[0], message("inv:lost"))
        rec = await until_state(guard.store, "inv:lost", State.DELIVERED)
        lossy_redis.lose(b"", times=0)
        usage = await guard.store.cap_usage("acme", guard.clock(), month_of(guard.clock()))
    assert reply.code == 250
    # Reserve (or enqueue), the data_sent note, the outcome (and in queue mode the claim,
    # the take-over and the cap): each lost its reply once and was run again.
    assert lossy_redis.lost >= 3
    assert upstream.event_keys() == ["inv:lost"]
    assert (usage.hour, usage.month) == (1, 1), "one unit for one upstream submission"
    assert [a.outcome for a in rec.attempts] == ["delivered"]


# --- 8. cap units: a refusal before DATA and a lost reservation reply give theirs back ----------
async def test_a_refusal_before_data_gives_its_cap_unit_back(
    tmp: Path, upstream: Upstream, store_url: str
) -> None:
    upstream.handler.script = [
        Behaviour(rcpt={"customer@example.com": "550 5.7.1 relaying denied"}),
        Behaviour(mail="451 4.3.0 try later"),
    ]
    cfg = config(tmp, upstream, store_url)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        refused = await send(port, message("r:1"))
        later = await send(port, message("r:2"))
        sent = await send(port, message("r:3"))
        assert guard.store is not None
        usage = await guard.store.cap_usage("acme", guard.clock(), month_of(guard.clock()))
    assert (refused.code, later.code, sent.code) == (550, 451, 250)
    assert upstream.handler.data_commands == 1
    assert (usage.hour, usage.month) == (1, 1)


async def test_a_lost_reservation_reply_refunds_and_the_takeover_sends_once(
    tmp: Path, upstream: Upstream, lossy_redis: LostReplyProxy
) -> None:
    cfg = config(tmp, upstream, lossy_redis.url)
    cfg["event_key"]["lease"] = "1s"
    cfg["event_key"]["inflight_wait"] = "100ms"
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        assert guard.store is not None
        # The reservation runs in Redis, its reply and its retry's reply are lost: the client
        # hears 451 4.3.0 and the record stays reserved by an attempt that will never send.
        lossy_redis.lose(b"EVALSHA", times=2)
        first = await send(guard.ports[0], message("inv:r"))
        now = guard.clock()
        after_loss = await guard.store.cap_usage("acme", now, month_of(now))
        rec = await record(guard, "inv:r")
        clock.t += 1.1  # its lease runs out
        retry = await send(guard.ports[0], message("inv:r"))
        now = guard.clock()
        usage = await guard.store.cap_usage("acme", now, month_of(now))
    assert first.code == 451 and first.text.startswith("4.3.0")
    assert rec.state is State.IN_FLIGHT
    assert (after_loss.hour, after_loss.month) == (0, 0)
    assert retry.code == 250
    assert upstream.event_keys() == ["inv:r"]
    assert (usage.hour, usage.month) == (1, 1)


# --- 6. resolve --as retry while the owner may still be in DATA ---------------------------------
async def test_resolve_retry_waits_for_an_owner_that_may_still_be_sending(
    tmp: Path, upstream: Upstream
) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=2.0)
    cfg = config(tmp, upstream, f"sqlite:///{tmp / 'state.db'}")
    path = write_config(tmp / "c.yaml", cfg)
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        port = guard.ports[0]
        owner = asyncio.create_task(send(port, message("inv:slow")))
        await upstream.wait_received(1)
        # The owner is in DATA; its lease runs out (a stalled store, failing renewals).
        clock.t += 31
        held = await send(port, message("inv:slow"))
        refused = await asyncio.to_thread(
            cli, "resolve", "acme", "inv:slow", "--as", "retry", "-c", str(path)
        )
        still = await send(port, message("inv:slow"))
        done = await owner
        final = await record(guard, "inv:slow")
        after = await asyncio.to_thread(cli, "resolve", "acme", "inv:slow", "--as", "retry", "-c", str(path))
    assert held.code == 451 and "held" in held.text
    code, _, err = refused
    assert code == 1 and "may still be sending" in err and "--force" in err
    assert guard.instance in err
    assert still.code == 451 and "held" in still.text
    # The owner's 250 closes the event: the key reads delivered, not unknown.
    assert done.code == 250 and final.state is State.DELIVERED
    assert after[0] == 1 and "delivered, not unknown" in after[2]
    assert upstream.event_keys() == ["inv:slow"]


async def test_resolve_retry_force_is_audited(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=1.0)
    cfg = config(tmp, upstream, f"sqlite:///{tmp / 'state.db'}")
    path = write_config(tmp / "c.yaml", cfg)
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        owner = asyncio.create_task(send(guard.ports[0], message("inv:f")))
        await upstream.wait_received(1)
        clock.t += 31
        await send(guard.ports[0], message("inv:f"))
        code, out, _ = await asyncio.to_thread(
            cli, "resolve", "acme", "inv:f", "--as", "retry", "--force", "-c", str(path)
        )
        rec = await record(guard, "inv:f")
        await owner
    assert code == 0 and "deferred" in out
    assert rec.audit[-1].action == "resolve:retry" and "forced" in rec.audit[-1].note


# --- 7. leases on the store's clock --------------------------------------------------------------
async def test_an_instance_whose_clock_is_behind_never_calls_a_live_lease_dead(
    tmp: Path, upstream: Upstream
) -> None:
    """Instance A's host clock is 90 s behind (`faketime`). Before leases were measured on
    the store's clock, B read A's live lease as long expired and held the event `unknown`
    while A was delivering it. Now B waits for A's outcome and answers it."""
    assert shutil.which("faketime"), "faketime is needed (scripts/test installs it)"
    (tmp / "redis-data").mkdir()
    redis = RedisServer(tmp / "redis-data", durable=True)
    redis.start()
    guards: list[GuardProcess] = []
    try:
        ports = [free_port(), free_port()]
        for name, port, prefix in (("a", ports[0], ("faketime", "-f", "-90s")), ("b", ports[1], ())):
            cfg = base_config(tmp, upstream.port, instance=name, store__url=redis.url)
            cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
            cfg["event_key"] = {
                "inflight_wait": "8s",
                "lease": "3s",
                "min_retry_interval": "60s",
                "strip": False,
            }
            cfg["providers"][0]["timeouts"]["data"] = "10s"
            g = GuardProcess(write_config(tmp / f"{name}.yaml", cfg), tmp / f"{name}.log", prefix)
            g.start()
            guards.append(g)
        for g, port in zip(guards, ports, strict=True):
            await g.wait_port(port)
        upstream.handler.default = Behaviour(hang_after_dot=2.0)
        on_a = asyncio.create_task(send(ports[0], message("inv:skew")))
        await upstream.wait_received(1)
        on_b = await send(ports[1], message("inv:skew"))
        first = await on_a
    finally:
        for g in guards:
            g.kill()
        redis.stop()
    assert first.code == 250
    assert on_b.code == 250 and "duplicate" in on_b.text, str(on_b)
    assert upstream.event_keys() == ["inv:skew"]


# --- 9. a Redis that may forget is refused at start ---------------------------------------------
async def test_serve_refuses_a_redis_that_may_forget_unless_told(
    tmp: Path, redis_server: RedisServer
) -> None:
    port = free_port()
    cfg = base_config(tmp, None, store__url=redis_server.url)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    g = GuardProcess(write_config(tmp / "c.yaml", cfg), tmp / "guard.log")
    g.start()
    assert g.proc is not None
    rc = await asyncio.to_thread(g.proc.wait, 20)
    g.stop()
    log = (tmp / "guard.log").read_text()
    assert rc == 1
    assert "appendonly is 'no'" in log and "store.unsafe" in log
    assert "Traceback" not in log
    cfg["store"]["unsafe"] = True
    write_config(tmp / "c.yaml", cfg)
    g = GuardProcess(tmp / "c.yaml", tmp / "guard2.log")
    g.start()
    try:
        await g.wait_port(port)
    finally:
        g.stop()
    assert "store may forget acknowledged writes" in (tmp / "guard2.log").read_text()


async def test_a_redis_down_at_start_is_checked_once_it_answers(tmp: Path) -> None:
    """An instance started while Redis is down serves (451 4.3.0 meanwhile); when the Redis
    that comes up may forget writes, it stops, naming the setting."""
    redis = RedisServer(tmp)
    port = free_port()
    cfg = base_config(tmp, None, store__url=redis.url)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    g = GuardProcess(write_config(tmp / "c.yaml", cfg), tmp / "guard.log")
    g.start()
    try:
        await g.wait_port(port)
        down = await send(port, message("inv:down"))
        redis.start()
        assert g.proc is not None
        rc = await asyncio.to_thread(g.proc.wait, 20)
    finally:
        g.stop()
        redis.stop()
    log = (tmp / "guard.log").read_text()
    assert down.code == 451 and down.text.startswith("4.3.0")
    assert rc == 1 and "appendonly is 'no'" in log and "Traceback" not in log


# --- §11.6: an error before the final dot is never `unknown` ------------------------------------
class HangsUpAtData:
    """A provider that takes MAIL and RCPT, then closes the connection on the DATA command
    (no 354): nothing of the message was sent, so nothing can have been accepted."""

    def __init__(self) -> None:
        self.port = free_port()
        self.data_commands = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._session, "127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _session(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"220 hangs-up ESMTP\r\n")
        while line := await r.readline():
            verb = line[:4].upper()
            if verb in (b"EHLO", b"HELO"):
                w.write(b"250-hangs-up\r\n250 8BITMIME\r\n")
            elif verb == b"DATA":
                self.data_commands += 1
                w.close()
                return
            elif verb == b"QUIT":
                w.write(b"221 bye\r\n")
                w.close()
                return
            else:
                w.write(b"250 ok\r\n")
            await w.drain()


async def test_a_provider_lost_before_354_is_retryable_and_refunded(tmp: Path, store_url: str) -> None:
    bad = HangsUpAtData()
    await bad.start()
    cfg = base_config(tmp, bad.port)
    cfg["store"] = {"url": store_url, **({"unsafe": True} if store_url.startswith("redis") else {})}
    try:
        async with running_guard(cfg) as guard:
            first = await send(guard.ports[0], message("inv:354"))
            rec = await record(guard, "inv:354")
            now = guard.clock()
            assert guard.store is not None
            usage = await guard.store.cap_usage("acme", now, month_of(now))
    finally:
        await bad.stop()
    assert bad.data_commands == 1
    assert first.code == 451 and first.text.startswith("4.4.1"), str(first)
    assert rec.state is State.DEFERRED and [a.outcome for a in rec.attempts] == ["unavailable"]
    assert (usage.hour, usage.month) == (0, 0)


@pytest.mark.parametrize("delivery", ["relay", "queue"])
async def test_a_lost_data_sent_note_then_a_store_outage_ends_not_sent(
    tmp: Path, upstream: Upstream, lossy_redis: LostReplyProxy, delivery: str
) -> None:
    """DESIGN.md §18 "Nothing sent is never unknown": the data_sent note lands but its reply
    is lost, and the store stays unreachable for 2 s (a failover). Nothing reached DATA, so
    the attempt must read "not sent" (unavailable: retried), never `unknown`, and the event
    is then sent exactly once with one cap unit."""
    cfg = config(tmp, upstream, lossy_redis.url, zones__acme__delivery=delivery)
    cfg["event_key"]["lease"] = "30s"  # so nothing here can pass by a lease running out
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        lossy_redis.lose(b'"phase":"data_sent"', times=1, then_down=2.0)
        first = await send(guard.ports[0], message("inv:down"), timeout=60)
        deadline = time.monotonic() + 20
        rec: Record | None = None
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreUnavailable):
                rec = await record(guard, "inv:down")
                if rec.attempts:
                    break
            await asyncio.sleep(0.1)
        assert rec is not None and rec.attempts, "no attempt written within 20 s"
        assert upstream.handler.data_commands == 0
        if delivery == "relay":
            assert first.code == 451, str(first)
            again = await send(guard.ports[0], message("inv:down"))
            assert again.code == 250, str(again)
        else:
            assert first.code == 250 and "queued" in first.text, str(first)
        done = await until_state(guard.store, "inv:down", State.DELIVERED, timeout=15)
        now = guard.clock()
        usage = await guard.store.cap_usage("acme", now, month_of(now))
    assert lossy_redis.lost == 1
    assert rec.attempts[0].outcome == "unavailable", rec.attempts
    assert [a.outcome for a in done.attempts] == ["unavailable", "delivered"]
    assert upstream.event_keys() == ["inv:down"]
    assert (usage.hour, usage.month) == (1, 1)
