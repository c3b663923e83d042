"""`alert_at` (DESIGN.md §16): crossing a share of a zone's cap logs one warning per window
and per threshold, and `smtpguard_cap_used_ratio{zone,window}` shows the share used.
Real client, real listener, real SQLite store, a counting upstream; the clock is the one
thing faked, to move into the next hour."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from smtpguard.config import ConfigError, loads
from smtpguard.policy.alerts import AlertLedger, used_ratio
from smtpguard.server import Server
from smtpguard.server.housekeeping import GAUGE_INTERVAL
from smtpguard.store import CapUsage
from tests.ops.test_ops import http_get, sample
from tests.support import FakeClock, Upstream, base_config, message, running_guard, send
from tests.support.eventually import eventually

MID_JUNE = datetime(2026, 6, 15, 10, 5, tzinfo=UTC).timestamp()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[tuple[str, float]]:
    return [
        (r.__dict__["window"], r.__dict__["threshold"])
        for r in caplog.records
        if r.name == "smtpguard.alerts" and r.levelno == logging.WARNING
    ]


async def ratio(port: int, window: str, expected: float, timeout: float = 10) -> float:
    """The gauge once it shows `expected` (it is refreshed shortly after a send), or its last value."""
    value = -1.0
    async with asyncio.timeout(timeout):
        while True:
            _, body = await http_get(port, "/metrics")
            if "smtpguard_cap_used_ratio{" in body:
                value = sample(body, "smtpguard_cap_used_ratio", zone="acme", window=window)
                if abs(value - expected) < 1e-9:
                    return value
            await asyncio.sleep(0.1)


async def gauge_pass(guard: Server) -> None:
    """Until serve's gauge loop has made one whole pass from here on: pruned the series, then
    observed every configured zone (its period is housekeeping.GAUGE_INTERVAL). Watched by
    wrapping the real CapAlerts methods that pass calls; they still run."""
    alerts = guard.cap_alerts
    assert alerts is not None
    seen: list[str] = []
    prune, observe = alerts.prune, alerts.observe

    def pruned() -> None:
        seen.clear()
        seen.append("")
        prune()

    def observed(zone: str, usage: CapUsage, now: float) -> None:
        if seen:
            seen.append(zone)
        observe(zone, usage, now)

    alerts.prune, alerts.observe = pruned, observed  # type: ignore[method-assign]
    try:
        zones = set(guard.config.zones)
        await eventually(lambda: zones <= set(seen), timeout=3 * GAUGE_INTERVAL, interval=0.05)
        assert zones <= set(seen), "the gauge loop made no whole pass"
    finally:
        alerts.prune, alerts.observe = prune, observe  # type: ignore[method-assign]


async def test_one_warning_per_threshold_per_window_and_the_gauge(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="smtpguard.alerts")
    clock = FakeClock()
    clock.t = MID_JUNE
    cfg = base_config(
        tmp,
        upstream.port,
        metrics={"address": "127.0.0.1:0"},
        zones__acme__hourly_cap=10,
        zones__acme__monthly_cap=20,
        zones__acme__alert_at=[0.5, 0.8],
    )
    sent = 0
    async with running_guard(cfg, clock=clock) as guard:
        assert guard.health is not None
        port, health = guard.ports[0], guard.health.port

        async def burst(n: int) -> None:
            nonlocal sent
            for _ in range(n):
                sent += 1
                reply = await send(port, message(f"alert:{sent}"))
                assert reply.code == 250, reply

        await burst(6)
        assert await ratio(health, "hour", 0.6) == 0.6
        assert warnings_of(caplog) == [("hour", 0.5)]
        # Still above 0.5 in the same hour: no second warning for it.
        await burst(1)
        assert await ratio(health, "hour", 0.7) == 0.7
        assert warnings_of(caplog) == [("hour", 0.5)]

        # The next hour: the sliding window is empty again, a new alert window begins.
        clock.t += 3601
        assert await ratio(health, "hour", 0.0) == 0.0
        await burst(5)
        assert await ratio(health, "hour", 0.5) == 0.5
        assert await ratio(health, "month", 12 / 20) == 0.6
        await burst(3)
        assert await ratio(health, "hour", 0.8) == 0.8
        assert await ratio(health, "month", 15 / 20) == 0.75
        # Idle until the gauge loop has looked at every zone again: nothing is warned twice.
        await gauge_pass(guard)
    assert len(upstream.received) == sent == 15
    assert sorted(warnings_of(caplog)) == sorted(
        [("hour", 0.5), ("hour", 0.5), ("month", 0.5), ("hour", 0.8)]
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "smtpguard.alerts"]
    assert "zone acme has used 80% of its hourly cap" in lines


def test_alert_ledger_is_per_window_and_threshold() -> None:
    ledger = AlertLedger()
    hour = MID_JUNE
    assert ledger.newly_crossed("z", "hour", 0.96, [0.8, 0.95], hour) == [0.8, 0.95]
    assert ledger.newly_crossed("z", "hour", 1.0, [0.8, 0.95], hour + 60) == []
    assert ledger.newly_crossed("other", "hour", 0.85, [0.8, 0.95], hour) == [0.8]
    assert ledger.newly_crossed("z", "month", 0.85, [0.8, 0.95], hour) == [0.8]
    assert ledger.newly_crossed("z", "hour", 0.85, [0.8, 0.95], hour + 3600) == [0.8]
    assert used_ratio(3, 0) is None and used_ratio(30, 20) == 1.0


@pytest.mark.parametrize(
    ("alert_at", "problem"),
    [
        pytest.param([0.95, 0.8], "ascending", id="unsorted"),
        pytest.param([0.8, 0.8], "ascending", id="repeated"),
        pytest.param([0], "> 0 and <= 1", id="zero"),
        pytest.param([1.5], "> 0 and <= 1", id="over-one"),
    ],
)
def test_alert_at_config_errors(tmp: Path, alert_at: list[float], problem: str) -> None:
    cfg = base_config(tmp, 2525, zones__acme__alert_at=alert_at)
    with pytest.raises(ConfigError) as e:
        loads(yaml.safe_dump(cfg))
    text = "\n".join(e.value.problems)
    assert "zones.acme.alert_at" in text and problem in text, text


def has_series(body: str, **labels: str) -> bool:
    try:
        sample(body, "smtpguard_cap_used_ratio", **labels)
    except AssertionError:
        return False
    return True


async def test_a_ratio_series_goes_when_its_cap_becomes_zero_or_its_zone_is_removed(
    tmp: Path, upstream: Upstream
) -> None:
    # A series left at its last value keeps the example rules' SmtpguardCapNearlyUsed
    # firing for ever after the cap is set to 0 (no share) or the zone is removed.
    cfg = base_config(
        tmp,
        upstream.port,
        metrics={"address": "127.0.0.1:0"},
        zones__acme__hourly_cap=4,
        zones__acme__monthly_cap=50,
    )
    path = tmp / "smtpguard.yaml"
    async with running_guard(cfg, config_path=path) as guard:
        assert guard.health is not None
        health = guard.health.port
        for i in range(3):
            assert (await send(guard.ports[0], message(f"zero:{i}"))).code == 250
        assert await ratio(health, "hour", 0.75) == 0.75
        _, body = await http_get(health, "/metrics")
        assert has_series(body, zone="globex", window="hour")
        cfg["zones"]["acme"]["hourly_cap"] = 0
        del cfg["zones"]["globex"]
        path.write_text(yaml.safe_dump(cfg))
        assert await guard.reload()
        refused = await send(guard.ports[0], message("zero:after"))
        # Until the gauge loop has pruned and observed every zone again.
        await gauge_pass(guard)
        _, body = await http_get(health, "/metrics")
    assert refused.code == 451, refused
    assert len(upstream.received) == 3
    assert not has_series(body, zone="acme", window="hour"), body
    assert has_series(body, zone="acme", window="month")
    assert not has_series(body, zone="globex", window="hour") and not has_series(
        body, zone="globex", window="month"
    )
