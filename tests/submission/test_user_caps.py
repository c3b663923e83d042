"""Per-user caps inside the zone's (DESIGN.md §16): `users[].hourly_cap` / `monthly_cap` give
each internal service its own limit. A message needs a unit of the zone's caps and one of its
user's, taken together; replies name the user. Counted at a real recording upstream, on two
instances sharing a real redis-server, on a SQLite file, and in queue mode."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from smtpguard.cli import main
from smtpguard.config import ConfigError, loads
from smtpguard.policy.limits import CapReached, Caps, cap_check, cap_reply, user_caps_for
from smtpguard.store import QueueEntry
from tests.invariants.test_multi_instance import is_451, two_instances
from tests.queue.test_queue import queue_config
from tests.support import (
    PASSWORD,
    Reply,
    Upstream,
    base_config,
    message,
    password_hash,
    running_guard,
    send,
    write_config,
)
from tests.support.eventually import eventually

SERVICE_PASSWORD = "svc-test-pass"


def users(**svc: Any) -> list[dict[str, Any]]:
    """acme's users: the app without caps of its own, and `svc` with the caps given."""
    return [
        {"username": "acme-app", "password_hash": password_hash(PASSWORD)},
        {"username": "svc", "password_hash": password_hash(SERVICE_PASSWORD), **svc},
    ]


async def as_svc(port: int, key: str) -> Reply:
    return await send(port, message(key), user="svc", password=SERVICE_PASSWORD)


def user_hourly(reply: Reply) -> bool:
    return is_451(reply, "4.7.0") and "user svc" in reply.text and "Hourly cap of 5" in reply.text


@pytest.mark.slow
async def test_user_cap_is_exact_across_two_instances_and_the_zone_cap_still_applies(
    tmp: Path, upstream: Upstream
) -> None:
    overrides = {"zones__acme__users": users(hourly_cap=5), "zones__acme__hourly_cap": 10}
    async with two_instances(tmp, upstream, **overrides) as pair:
        svc = await asyncio.gather(*(as_svc(pair.port(i), f"svc:{i}") for i in range(30)))
        # A refused message left no attempt and no min_retry_interval (60 s): sent again, it
        # meets the same cap, not "too soon".
        again = await as_svc(pair.port(1), next(f"svc:{i}" for i, r in enumerate(svc) if r.code != 250))
        # Another user of the zone still sends, up to what the zone's cap (10) leaves: 5.
        app = await asyncio.gather(*(send(pair.port(i), message(f"app:{i}")) for i in range(8)))
    sent_svc = [f"svc:{i}" for i, r in enumerate(svc) if r.code == 250]
    sent_app = [f"app:{i}" for i, r in enumerate(app) if r.code == 250]
    print(
        f"user cap 5/hour, 30 concurrent sessions on two instances: {len(sent_svc)} relayed, "
        f"{sum(user_hourly(r) for r in svc)} refused naming the user; other user {len(sent_app)}/8 "
        f"under the zone cap 10; upstream {len(upstream.received)}"
    )
    assert len(sent_svc) == 5
    assert sum(user_hourly(r) for r in svc) == 25, [str(r) for r in svc if r.code != 250]
    assert len(sent_app) == 5
    zone_refused = [r for r in app if r.code != 250]
    assert all(is_451(r, "4.7.0") and "zone acme" in r.text and "user" not in r.text for r in zone_refused)
    assert user_hourly(again)
    assert Counter(upstream.event_keys()) == Counter(sent_svc + sent_app)


async def test_user_cap_is_exact_under_concurrency_on_sqlite(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__users=users(hourly_cap=5))
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        svc = await asyncio.gather(*(as_svc(port, f"svc:{i}") for i in range(30)))
        app = await asyncio.gather(*(send(port, message(f"app:{i}")) for i in range(3)))
    sent_svc = [f"svc:{i}" for i, r in enumerate(svc) if r.code == 250]
    assert len(sent_svc) == 5
    assert sum(user_hourly(r) for r in svc) == 25, [str(r) for r in svc if r.code != 250]
    assert [r.code for r in app] == [250] * 3
    assert Counter(upstream.event_keys()) == Counter(sent_svc + [f"app:{i}" for i in range(3)])


async def test_user_monthly_cap_is_550_naming_the_user_and_shown_in_stats(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__users=users(monthly_cap=3))
    path = write_config(tmp / "c.yaml", cfg)
    async with running_guard(cfg) as guard:
        svc = [await as_svc(guard.ports[0], f"m:{i}") for i in range(5)]
        app = await send(guard.ports[0], message("app:m"))
    # After the stop, which flushes the counters (each instance writes them once a second).
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["stats", "acme", "--json", "-c", str(path)]) == 0
    stats = json.loads(capsys.readouterr().out)["zones"][0]
    assert [r.code for r in svc] == [250, 250, 250, 550, 550]
    assert all(
        r.text.startswith("5.7.0") and "Monthly cap of 3" in r.text and "user svc" in r.text for r in svc[3:]
    )
    assert app.code == 250
    assert upstream.event_keys() == ["m:0", "m:1", "m:2", "app:m"]
    # The zone's own hourly cap (business: 60) bounds the user's hour, which it sets no cap for.
    assert stats["user_caps"] == [
        {"username": "svc", "hour": {"used": 3, "limit": 60}, "month": {"used": 3, "limit": 3}}
    ]
    assert stats["cap"]["month"]["used"] == 4
    assert stats["held"].get("user_cap_month") == 2


async def test_queue_mode_counts_the_submitting_users_cap_at_delivery(tmp: Path, upstream: Upstream) -> None:
    cfg = queue_config(tmp, upstream.port, zones__acme__users=users(hourly_cap=2))
    async with running_guard(cfg) as guard:
        svc = [await as_svc(guard.ports[0], f"q:{i}") for i in range(5)]
        app = [await send(guard.ports[0], message(f"qa:{i}")) for i in range(3)]
        await upstream.wait_received(5)
        store = guard.store
        assert store is not None

        # Each of the rest claimed and given back for the user's hour (due again far on):
        # only then does "nothing more sent" below mean anything.
        def held_for_the_hour(es: list[QueueEntry]) -> bool:
            return len(es) == 3 and all(not e.claimed and (e.due_at or 0) > time.time() + 600 for e in es)

        entries = await eventually(
            lambda: store.queue_entries("acme"), held_for_the_hour, timeout=10, interval=0.05
        )
        assert held_for_the_hour(entries), entries
        waiting = sorted(e.key for e in entries)
        held = await guard.store.get("acme", waiting[0]) if waiting else None
    # Accepted with a durable 250 each; the user's cap holds its lane, not the zone's.
    assert all(r.code == 250 and "queued as" in r.text for r in svc + app)
    keys = upstream.event_keys()
    assert Counter(keys) == Counter(
        [k for k in keys if k and k.startswith("q:")] + [f"qa:{i}" for i in range(3)]
    )
    assert sum(1 for k in keys if k and k.startswith("q:")) == 2
    assert len(keys) == 5 and len(set(keys)) == 5
    assert len(waiting) == 3 and all(k.startswith("q:") for k in waiting)
    assert held is not None and held.username == "svc" and held.attempts == ()


def test_user_caps_are_validated_and_unknown_user_keys_refused(tmp: Path) -> None:
    def load_with(**svc: Any) -> str:
        text = write_config(
            tmp / "c.yaml", base_config(tmp, 2525, zones__acme__users=users(**svc))
        ).read_text()
        with pytest.raises(ConfigError) as e:
            loads(text)
        return "\n".join(e.value.problems)

    assert "zones.acme.users[1].hourly_cap" in load_with(hourly_cap=-1)
    assert "zones.acme.users[1].monthly_cap" in load_with(monthly_cap=-5)
    assert "zones.acme.users[1].daily_cap" in load_with(daily_cap=3)
    good = loads(
        write_config(
            tmp / "ok.yaml", base_config(tmp, 2525, zones__acme__users=users(hourly_cap=0, monthly_cap=9))
        ).read_text()
    )
    svc = good.zones["acme"].users[1]
    assert (svc.hourly_cap, svc.monthly_cap) == (0, 9)
    assert good.zones["acme"].users[0].hourly_cap is None


def test_a_users_caps_sit_inside_the_zones_and_its_replies_name_it() -> None:
    zone = Caps(hourly=60, monthly=12_000)
    assert user_caps_for(zone, None, None) is None
    assert user_caps_for(zone, 5, None) == Caps(hourly=5, monthly=12_000)
    assert user_caps_for(zone, None, 300) == Caps(hourly=60, monthly=300)
    # No user caps: the unit is the zone's only, whoever sends.
    assert cap_check("acme", zone, "tok", 1e9, "svc", None).user is None
    hourly = cap_reply("acme", CapReached("hour", 5, 1_790_000_000.0, user="svc"))
    assert (hourly.code, hourly.enhanced) == (451, "4.7.0")
    assert "user svc of zone acme" in hourly.text and "2026-09-21T" in hourly.text
    monthly = cap_reply("acme", CapReached("month", 3, user="svc"))
    assert (monthly.code, monthly.enhanced) == (550, "5.7.0") and "user svc" in monthly.text
    assert "user" not in cap_reply("acme", CapReached("month", 3)).text
