"""Zone controls end to end: caps, kill switch, suppression, stats — real client, real
upstream, and the CLI against the same store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from smtpguard.cli import main
from tests import support
from tests.support import OTHER_PASSWORD, Upstream, base_config, message, running_guard, send, write_config


def cli(path: Path, *args: str) -> int:
    return main([*args, "-c", str(path)])


async def test_hourly_cap_is_exact_and_duplicates_consume_nothing(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__hourly_cap=3)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        replies = [await send(port, message(f"cap{i}")) for i in range(3)]
        dup = await send(port, message("cap0"))
        over = await send(port, message("cap9"))
    assert [r.code for r in replies] == [250, 250, 250]
    assert dup.code == 250 and "duplicate" in dup.text
    assert over.code == 451 and over.text.startswith("4.7.0") and "slot frees at" in over.text
    assert upstream.event_keys() == ["cap0", "cap1", "cap2"]


async def test_concurrent_submissions_never_overshoot_the_cap(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__hourly_cap=10)
    async with running_guard(cfg) as guard:
        replies = await asyncio.gather(*(send(guard.ports[0], message(f"c{i}")) for i in range(30)))
    assert sum(r.code == 250 for r in replies) == 10
    assert sum(r.code == 451 and r.text.startswith("4.7.0") for r in replies) == 20
    assert len(upstream.received) == 10


async def test_monthly_cap_is_permanent(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__monthly_cap=1)
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], message("m1"))).code == 250
        over = await send(guard.ports[0], message("m2"))
    assert over.code == 550 and over.text.startswith("5.7.0") and "Monthly cap of 1" in over.text
    assert len(upstream.received) == 1


async def test_cap_rejection_records_no_attempt(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__hourly_cap=0)
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], message("z1"))).code == 451
        assert guard.store is not None
        assert await guard.store.get("acme", "z1") is None
    assert upstream.received == []


async def test_pause_via_cli_holds_new_events_but_answers_duplicates(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port)
    path = write_config(tmp / "c.yaml", cfg)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        assert (await send(port, message("p1"))).code == 250
        assert await asyncio.to_thread(cli, path, "pause", "acme") == 0
        held = await send(port, message("p2"))
        dup = await send(port, message("p1"))
        other_zone = await send(
            port,
            message("p3", sender="news@globex.example"),
            user="globex-app",
            password=OTHER_PASSWORD,
            sender="news@globex.example",
        )
        assert await asyncio.to_thread(cli, path, "resume", "acme") == 0
        after = await send(port, message("p2"))
    assert held.code == 451 and held.text.startswith("4.7.0") and "paused" in held.text
    assert dup.code == 250 and "duplicate" in dup.text
    assert other_zone.code == 250
    assert after.code == 250 and "duplicate" not in after.text
    assert sorted(k for k in upstream.event_keys() if k) == ["p1", "p2", "p3"]


async def test_config_paused_zone(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__paused=True)
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("cp1"))
    assert reply.code == 451 and "paused" in reply.text
    assert upstream.received == []


async def test_suppression_lists_zone_and_global(
    tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, upstream.port)
    path = write_config(tmp / "c.yaml", cfg)
    csv_file = tmp / "import.csv"
    csv_file.write_text("address,reason\nbulk1@example.com,complained\nBulk2@EXAMPLE.com,\n")
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        assert (
            await asyncio.to_thread(
                cli, path, "suppress", "add", "acme", "Zed@Example.COM", "--reason", "asked"
            )
            == 0
        )
        assert await asyncio.to_thread(cli, path, "suppress", "add", "global", "all@example.com") == 0
        assert await asyncio.to_thread(cli, path, "suppress", "import", "acme", str(csv_file)) == 0
        zone_hit = await send(port, message("s1", to="Zed@example.com"), recipients=["Zed@example.com"])
        global_hit = await send(port, message("s2", to="all@example.com"), recipients=["all@example.com"])
        globex_zed = await send(
            port,
            message("s3", sender="news@globex.example", to="Zed@example.com"),
            user="globex-app",
            password=OTHER_PASSWORD,
            sender="news@globex.example",
            recipients=["Zed@example.com"],
        )
        imported = await send(port, message("s4", to="Bulk2@example.com"), recipients=["Bulk2@example.com"])
        capsys.readouterr()
        assert await asyncio.to_thread(cli, path, "suppress", "list", "acme", "--json") == 0
        listed = json.loads(capsys.readouterr().out)["entries"]
        assert await asyncio.to_thread(cli, path, "suppress", "export", "acme") == 0
        exported = capsys.readouterr().out
        assert await asyncio.to_thread(cli, path, "suppress", "remove", "acme", "Zed@EXAMPLE.com") == 0
        # Not on the list (any more): "no such entry", exit 3.
        assert await asyncio.to_thread(cli, path, "suppress", "remove", "acme", "Zed@example.com") == 3
        support.suppressions_refreshed(guard)  # a change made elsewhere applies within one refresh
        after = await send(port, message("s1", to="Zed@example.com"), recipients=["Zed@example.com"])
    assert zone_hit.code == 550 and zone_hit.text.startswith("5.1.1") and "acme" in zone_hit.text
    assert global_hit.code == 550 and "global" in global_hit.text
    assert globex_zed.code == 250  # acme's list never touches globex
    assert imported.code == 550
    # Kept case-folded: the form in which every list is compared (policy/senders.suppression_key).
    assert {e["address"] for e in listed} == {"zed@example.com", "bulk1@example.com", "bulk2@example.com"}
    assert exported.splitlines()[0] == "address,reason,at" and "complained" in exported
    assert after.code == 250
    assert upstream.event_keys() == ["s3", "s1"]


async def test_stats_json(tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__hourly_cap=2)
    path = write_config(tmp / "c.yaml", cfg)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        await send(port, message("t1"))
        await send(port, message("t1"))
        await send(port, message("t2"))
        await send(port, message("t3"))
        await send(port, message("t4", sender="x@evil.example"), sender="x@evil.example")
        assert guard.store is not None
        await guard.stats.flush(guard.store)
    assert await asyncio.to_thread(cli, path, "stats", "acme", "--json") == 0
    doc = json.loads(capsys.readouterr().out)["zones"][0]
    assert doc["zone"] == "acme" and doc["sent"] == 2 and doc["duplicates"] == 1
    assert doc["held"]["cap_hour"] == 1 and doc["rejected"]["envelope"] == 1
    assert doc["cap"]["hour"] == {"used": 2, "limit": 2}
    assert doc["cap"]["month"]["used"] == 2 and doc["paused"] is False
    assert await asyncio.to_thread(cli, path, "stats", "nosuch") == 1
