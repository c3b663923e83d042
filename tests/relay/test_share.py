"""A standby's steady share of relayed mail (DESIGN.md §12 `share`): a stable fraction of
event keys, the same provider for a retry of the same key, and only while the standby is
ready (its probe passed) and its circuit closed. Counted at two real upstreams."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from smtpguard.config import MaildirProviderConfig, loads
from smtpguard.policy.breaker import Breaker
from smtpguard.policy.share import Candidate, shared_provider, slot
from smtpguard.readiness.prober import Prober
from smtpguard.relay import Envelope, MaildirProvider, Route
from smtpguard.server import Server
from tests.support import (
    Behaviour,
    FakeClock,
    Upstream,
    base_config,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.eventually import eventually


# --- the pure choice -------------------------------------------------------------------------
def test_a_two_percent_share_takes_two_percent_of_keys() -> None:
    keys = [f"invoice:acme:{i}" for i in range(5000)]
    chosen = [k for k in keys if shared_provider(slot("acme", k), [Candidate("standby", 0.02, True)])]
    # 100 expected; a binomial's standard deviation here is ~10.
    assert 70 <= len(chosen) <= 130, len(chosen)
    # The same key always lands in the same place: a retry takes the same route.
    again = [k for k in keys if shared_provider(slot("acme", k), [Candidate("standby", 0.02, True)])]
    assert again == chosen


def test_the_zone_is_part_of_the_choice() -> None:
    keys = [f"k{i}" for i in range(2000)]
    a = {k for k in keys if slot("acme", k) < 0.1}
    b = {k for k in keys if slot("globex", k) < 0.1}
    assert a != b


def test_each_standby_keeps_its_own_interval() -> None:
    keys = [f"k{i}" for i in range(5000)]
    both = [Candidate("s1", 0.02, True), Candidate("s2", 0.03, True)]
    s1_down = [Candidate("s1", 0.02, False), Candidate("s2", 0.03, True)]
    picks = {k: shared_provider(slot("acme", k), both) for k in keys}
    assert 60 <= sum(p == "s1" for p in picks.values()) <= 140
    assert 100 <= sum(p == "s2" for p in picks.values()) <= 200
    # s1 unready: its keys go to the normal route, s2's keys do not move.
    for k in keys:
        p = shared_provider(slot("acme", k), s1_down)
        assert p == (None if picks[k] == "s1" else picks[k])
    assert shared_provider(0.5, []) is None


def _route(tmp: Path, share: float) -> Route:
    providers = [
        MaildirProvider(MaildirProviderConfig(name=n, kind="maildir", path=tmp / n)) for n in ("p", "s")
    ]
    return Route(providers, threshold=1, cooldown=60, clock=lambda: 1000.0, shares={"s": share})


def _env(key: str | None) -> Envelope:
    return Envelope("acme", key, "a1", "billing@acme.example", ("c@example.com",), b"x")


def test_route_order_needs_ready_and_a_closed_circuit(tmp: Path) -> None:
    route = _route(tmp, 1.0 - 1e-9)  # every key in the standby's share
    assert [p.name for p in route.order(_env("k1"))] == ["p", "s"]  # never probed: not ready
    route.ready["s"] = True
    assert [p.name for p in route.order(_env("k1"))] == ["s", "p"]
    assert [p.name for p in route.order(_env(None))] == ["p", "s"]  # no key: no identity to keep
    route.breakers["s"] = Breaker(1, 60).failure(1000.0)  # the circuit opens
    assert [p.name for p in route.order(_env("k1"))] == ["p", "s"]


# --- end to end, counted at two upstreams ----------------------------------------------------
@pytest.fixture
async def standby() -> Any:
    up = Upstream()
    await up.start()
    yield up
    await up.stop()


def share_config(
    tmp: Path, primary: Upstream, standby: Upstream, share: float, **extra: Any
) -> dict[str, Any]:
    cfg = base_config(tmp, primary.port)
    cfg["zones"]["acme"].update(hourly_cap=100_000, monthly_cap=1_000_000)
    cfg["providers"].append(
        dict(
            cfg["providers"][0], name="standby", port=standby.port, share=share, probe_interval="1h", **extra
        )
    )
    return cfg


async def until_probed(guard: Server, provider: str) -> bool:
    assert guard.prober is not None
    async with asyncio.timeout(10):
        while provider not in guard.prober.ready:
            guard.prober.probed.clear()
            await guard.prober.probed.wait()
    return guard.prober.ready[provider]


async def test_the_share_goes_to_the_ready_standby_by_key(
    tmp: Path, upstream: Upstream, standby: Upstream
) -> None:
    keys = [f"invoice:acme:{i}" for i in range(150)]
    expected = {k for k in keys if slot("acme", k) < 0.2}
    assert 15 <= len(expected) <= 50
    async with running_guard(share_config(tmp, upstream, standby, 0.2)) as guard:
        assert await until_probed(guard, "standby") is True
        assert 'smtpguard_provider_ready{provider="standby"} 1.0' in guard.metrics.render().decode()
        for k in keys:
            reply = await send(guard.ports[0], message(k))
            assert reply.code == 250, reply
    assert set(standby.event_keys()) == expected
    assert set(upstream.event_keys()) == set(keys) - expected
    assert len(standby.received) + len(upstream.received) == len(keys)
    # The probes opened no transaction on either upstream.
    assert standby.handler.transactions == len(expected)


async def test_a_retry_takes_the_same_route(tmp: Path, upstream: Upstream, standby: Upstream) -> None:
    key = next(f"retry:{i}" for i in range(1000) if slot("acme", f"retry:{i}") < 0.2)
    standby.handler.script = [Behaviour(data="451 4.3.0 try again later")]
    clock = FakeClock()
    async with running_guard(share_config(tmp, upstream, standby, 0.2), clock=clock) as guard:
        assert await until_probed(guard, "standby") is True
        first = await send(guard.ports[0], message(key))
        assert first.code == 451, first
        clock.t += 61  # past min_retry_interval
        second = await send(guard.ports[0], message(key))
        assert second.code == 250, second
    assert standby.handler.transactions == 2 and standby.event_keys() == [key]
    assert upstream.handler.transactions == 0


async def test_an_unready_standby_takes_no_share_and_is_logged(
    tmp: Path, upstream: Upstream, standby: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    # The standby is configured to AUTH, which this upstream does not offer: its probe fails.
    os.environ["SHARE_TEST_PASSWORD"] = "pw"
    config_path = tmp / "smtpguard.yaml"
    cfg = share_config(tmp, upstream, standby, 0.5, username="relay", password_env="SHARE_TEST_PASSWORD")
    keys = [f"invoice:acme:{i}" for i in range(30)]
    caplog.set_level(logging.INFO)
    try:
        async with running_guard(cfg, config_path=config_path) as guard:
            assert await until_probed(guard, "standby") is False
            assert 'smtpguard_provider_ready{provider="standby"} 0.0' in guard.metrics.render().decode()
            for k in keys:
                assert (await send(guard.ports[0], message(k))).code == 250
            # The probe result is published to the store in the background: `stats` reads it there.
            store = guard.store
            assert store is not None
            published = await eventually(
                store.probes, lambda ps: any(p.provider == "standby" for p in ps), timeout=5, interval=0.05
            )
            assert [(p.provider, p.ready) for p in published] == [("standby", False)], published
            stats = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "smtpguard",
                "stats",
                "--json",
                "-c",
                str(config_path),
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await stats.communicate()
    finally:
        del os.environ["SHARE_TEST_PASSWORD"]
    assert set(upstream.event_keys()) == set(keys) and standby.received == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "not ready" in r.getMessage()]
    assert len(warnings) == 1 and "AUTH" in warnings[0].getMessage()
    rows = {p["provider"]: p for p in json.loads(out)["providers"]}
    assert rows["standby"]["ready"] is False and rows["standby"]["probe"].startswith("AUTH")
    assert rows["primary"]["ready"] is None  # not probed


def test_share_needs_probe_interval_and_a_standby(tmp: Path) -> None:
    from smtpguard.config import ConfigError, loads

    cfg = base_config(tmp, 2525)
    cfg["providers"].append(dict(cfg["providers"][0], name="standby", share=0.02))
    import yaml

    with pytest.raises(ConfigError, match="share needs probe_interval"):
        loads(yaml.safe_dump(cfg))
    cfg = base_config(tmp, 2525)
    cfg["providers"][0].update(share=0.02, probe_interval="5m")
    with pytest.raises(ConfigError, match="primary"):
        loads(yaml.safe_dump(cfg))


def provider_gauges(guard: Server) -> str:
    return "\n".join(
        line
        for line in guard.metrics.render().decode().splitlines()
        if line.startswith("smtpguard_provider_ready{")
    )


async def test_a_reload_forgets_a_changed_providers_readiness_and_a_gone_providers_gauge(
    tmp: Path, upstream: Upstream, standby: Upstream
) -> None:
    path = tmp / "smtpguard.yaml"
    cfg = share_config(tmp, upstream, standby, 0.2)
    async with running_guard(cfg, config_path=path) as guard:
        assert await until_probed(guard, "standby") is True
        assert guard.route is not None and guard.route.ready["standby"] is True
        # Unchanged: the readiness survives the reload.
        cfg["zones"]["acme"]["hourly_cap"] = 99_999
        write_config(path, cfg)
        assert await guard.reload()
        assert guard.route.ready.get("standby") is True
        # Changed (another HELO name): not known to be ready until its next probe passes.
        cfg["providers"][1]["helo_name"] = "other.test"
        write_config(path, cfg)
        assert await guard.reload()
        assert guard.route.ready.get("standby") is None
        assert 'provider="standby"' not in provider_gauges(guard)
        assert await until_probed(guard, "standby") is True
        assert guard.route.ready["standby"] is True
        # Gone: its gauge goes with it.
        del cfg["providers"][1]
        write_config(path, cfg)
        assert await guard.reload()
        assert 'provider="standby"' not in provider_gauges(guard)


async def test_a_new_failure_reason_is_published(tmp: Path) -> None:
    """Not ready for one reason, then another: the change is reported (the store and
    `stats` show the current reason), not only the change of readiness."""
    up = Upstream()
    await up.start()
    cfg = base_config(tmp, up.port)
    cfg["providers"][0].update(username="relay", password_env="SHARE_REASON_PASSWORD", probe_interval="10s")
    config = loads(yaml.safe_dump(cfg))
    fast = config.providers[0].model_copy(update={"probe_interval": 0.1})  # below the 10s floor
    config = config.model_copy(update={"providers": [fast]})
    changes: list[tuple[bool, str]] = []
    changed = asyncio.Event()

    def on_change(_provider: str, ready: bool, detail: str) -> None:
        changes.append((ready, detail))
        changed.set()

    prober = Prober(config, {"primary": "pw"}, "guard.test", on_change)
    prober.start()
    try:
        async with asyncio.timeout(10):
            await changed.wait()
            assert changes[0][0] is False and changes[0][1].startswith("AUTH"), changes
            changed.clear()
            await up.stop()  # now refused at connect
            await changed.wait()
            # Several more probes with the same reason (counted), each a chance to report it again.
            seen = prober.probes
            probes = await eventually(
                lambda: prober.probes, lambda n: n >= seen + 3, timeout=10, interval=0.05
            )
            assert probes >= seen + 3, probes
    finally:
        await prober.stop()
        await up.stop()
    assert changes[1][0] is False and changes[1][1].startswith("connect"), changes
    assert len(changes) == 2, changes


async def test_stop_right_after_a_reload_does_not_wait_for_the_probe_interval(
    tmp: Path, upstream: Upstream, standby: Upstream
) -> None:
    """The reload's new prober is mid-probe when serve stops: the stop is prompt, not held
    for `probe_interval` (1h here) by a probe that swallowed its cancellation."""
    path = tmp / "smtpguard.yaml"
    cfg = share_config(tmp, upstream, standby, 0.2)
    # The bound is the assertion: a stop held for the probe interval (1 h) runs it out.
    async with asyncio.timeout(20):
        async with running_guard(cfg, config_path=path) as guard:
            assert await until_probed(guard, "standby") is True
            cfg["providers"][1]["helo_name"] = "other.test"
            write_config(path, cfg)
            assert await guard.reload()
