"""The operator's zone operations (DESIGN.md §14, §16) as the CLI prints and audits them and as
the console shows and audits them: pause and resume, suppression add/remove/import, and the
per-zone stats. Both front ends run one code path (smtpguard/desk.py); these tests pin what
each prints, writes to the store and audits, so moving that code changes none of it."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from smtpguard.cli import actor, main
from smtpguard.config import load
from smtpguard.console import views
from smtpguard.policy.limits import CapCheck, caps_for, month_of, user_caps_for
from smtpguard.server import Server
from smtpguard.store import Store, store_from_url
from tests.support import PASSWORD, Upstream, base_config, password_hash, running_guard, write_config
from tests.support.console import Operator, console_config, console_port

T = TypeVar("T")
EPOCH = 1_700_000_000.0
"""2023-11-14T22:13:20Z: when the seeded circuit and probe were written."""
UNTIL = 4_102_444_800.0
"""2100-01-01T00:00:00Z: a throttle that outlasts the test."""


def with_store(tmp: Path, fn: Callable[[Store], Awaitable[T]]) -> T:
    async def go() -> T:
        # The first open creates the store, as `serve` would have.
        store = store_from_url(f"sqlite:///{tmp / 'state.db'}")
        await store.open()
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(go())


def cli(capsys: pytest.CaptureFixture[str], path: Path, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "-c", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def zone_config(tmp: Path) -> dict[str, Any]:
    users = [
        {"username": "acme-app", "password_hash": password_hash(PASSWORD), "hourly_cap": 5},
        {"username": "acme-batch", "password_hash": password_hash(PASSWORD)},
    ]
    return base_config(tmp, None, zones__acme__users=users, zones__globex__providers=["local"])


def test_cli_pause_and_suppression_print_and_audit_as_cli_user(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp / "c.yaml", zone_config(tmp))
    assert with_store(tmp, lambda s: s.audit_log("acme", 0)) == []
    before = time.time()
    assert cli(capsys, path, "pause", "acme") == (0, "zone acme paused\n", "")
    assert with_store(tmp, lambda s: s.is_paused("acme")) is True
    assert (
        cli(capsys, path, "resume", "acme", "--json")[1]
        == '{\n  "schema": 1,\n  "zone": "acme",\n  "paused": false\n}\n'
    )
    assert cli(capsys, path, "suppress", "add", "acme", "Gone@Example.NET", "--reason", "asked") == (
        0,
        "Gone@example.net added to the acme suppression list\n",
        "",
    )
    assert cli(capsys, path, "suppress", "add", "acme", "Gone@example.net") == (
        0,
        "Gone@example.net already on the acme suppression list\n",
        "",
    )
    code, out, _ = cli(capsys, path, "suppress", "add", "global", "all@example.org", "--json")
    assert code == 0 and json.loads(out) == {
        "schema": 1,
        "zone": "global",
        "address": "all@example.org",
        "added": True,
    }
    csv_file = tmp / "list.csv"
    csv_file.write_text("address,reason\nGone@example.net,dup\nnew@example.com\nb@example.com,bounced\n")
    assert cli(capsys, path, "suppress", "import", "acme", str(csv_file)) == (
        0,
        "imported 2 new address(es) of 3 into the acme suppression list\n",
        "",
    )
    assert cli(capsys, path, "suppress", "remove", "acme", "b@example.com") == (
        0,
        "b@example.com removed from the acme suppression list\n",
        "",
    )
    assert cli(capsys, path, "suppress", "remove", "acme", "b@example.com") == (
        3,
        "",
        "smtpguard: b@example.com is not on the acme suppression list\n",
    )
    after = time.time()

    def entries(s: Store) -> Awaitable[list[Any]]:
        return s.suppress_list("acme")

    listed = with_store(tmp, entries)
    assert [(e.address, e.reason) for e in listed] == [
        # The store keeps addresses folded to lower case; the reply and the audit name the given one.
        ("gone@example.net", "asked"),
        ("new@example.com", "imported"),
    ]
    assert all(before - 1 <= e.at <= after + 1 for e in listed)
    code, out, _ = cli(capsys, path, "suppress", "export", "acme")
    assert code == 0 and re.fullmatch(
        r"address,reason,at\ngone@example\.net,asked,\S+Z\nnew@example\.com,imported,\S+Z\n", out
    ), out
    me = actor()
    log = with_store(tmp, lambda s: s.audit_log("acme", 0))
    assert [(e.actor, e.action, e.key, e.note) for e in reversed(log)] == [
        (me, "pause", "", ""),
        (me, "resume", "", ""),
        (me, "suppress:add", "Gone@example.net", "asked"),
        (me, "suppress:add", "Gone@example.net", ""),
        (me, "suppress:import", "", f"2 new of 3 from {csv_file}"),
        (me, "suppress:remove", "b@example.com", ""),
    ]
    assert all(before - 1 <= e.at <= after + 1 for e in log)
    glog = with_store(tmp, lambda s: s.audit_log("global", 0))
    assert [(e.actor, e.action, e.key) for e in glog] == [(me, "suppress:add", "all@example.org")]


async def seed(store: Store, path: Path) -> None:
    """Counters, cap units, pauses, a suppression, a circuit, a probe and a throttle."""
    now = store.now()
    zc = load(str(path)).zones["acme"]
    caps = caps_for(zc.plan, zc.hourly_cap, zc.monthly_cap)
    own = user_caps_for(caps, 5, None)
    for i in range(2):
        check = CapCheck("acme", caps, now - 3600, month_of(now), f"t{i}", now, "acme-app", own)
        assert await store.consume_cap(check) is None
    await store.add_counts(
        "acme",
        {"sent": 7, "duplicate": 2, "rejected:550": 3, "rejected:421": 1, "paused": 4, "in_flight": 1},
    )
    await store.add_counts("acme", {"deferred": 1, "unknown": 1, "failed": 5, "reused": 2, "other": 9})
    await store.set_class_paused("acme", "otp", True)
    await store.set_paused("globex", True)
    await store.suppress_add("acme", "x@example.com", "bounced", now)
    await store.set_circuit("i1", "local", "open", EPOCH)
    await store.set_probe("i1", "local", False, "connect refused", EPOCH)
    await store.set_throttled("local", UNTIL)


def test_cli_stats_prints_every_figure(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp / "c.yaml", zone_config(tmp))
    with_store(tmp, lambda s: seed(s, path))
    code, out, err = cli(capsys, path, "stats", "--json")
    assert code == 0, err
    acme_caps = caps_for("business", None, None)
    globex_caps = caps_for("solo", None, None)
    assert json.loads(out) == {
        "schema": 1,
        "zones": [
            {
                "zone": "acme",
                "sent": 7,
                "duplicates": 2,
                "deferred": 1,
                "failed": 5,
                "unknown": 1,
                "rejected": {"421": 1, "550": 3},
                "held": {"in_flight": 1, "paused": 4, "reused": 2},
                "cap": {
                    "hour": {"used": 2, "limit": acme_caps.hourly},
                    "month": {"used": 2, "limit": acme_caps.monthly},
                },
                "user_caps": [
                    {
                        "username": "acme-app",
                        "hour": {"used": 2, "limit": 5},
                        "month": {"used": 2, "limit": acme_caps.monthly},
                    }
                ],
                "paused": False,
                "paused_classes": ["otp"],
                "receivers": {},
                "paused_receivers": [],
                "queue": {},
                "suppressed": 1,
                "route": ["local"],
            },
            {
                "zone": "globex",
                "sent": 0,
                "duplicates": 0,
                "deferred": 0,
                "failed": 0,
                "unknown": 0,
                "rejected": {},
                "held": {},
                "cap": {
                    "hour": {"used": 0, "limit": globex_caps.hourly},
                    "month": {"used": 0, "limit": globex_caps.monthly},
                },
                "user_caps": [],
                "paused": True,
                "paused_classes": [],
                "receivers": {},
                "paused_receivers": [],
                "queue": {},
                "suppressed": 0,
                "route": ["local"],
            },
        ],
        "providers": [
            {
                "instance": "i1",
                "provider": "local",
                "circuit": "open",
                "since": "2023-11-14T22:13:20Z",
                "ready": False,
                "probe": "connect refused",
                "probed_at": "2023-11-14T22:13:20Z",
            }
        ],
        "throttled": {"local": "2100-01-01T00:00:00Z"},
    }
    code, out, err = cli(capsys, path, "stats")
    assert code == 0, err
    hour, month = f"2/{acme_caps.hourly}", f"2/{acme_caps.monthly}"
    ghour, gmonth = f"0/{globex_caps.hourly}", f"0/{globex_caps.monthly}"
    assert out.splitlines() == [
        f"{'zone':16} {'sent':>7} {'dups':>6} {'rejected':>8} {'hour':>9} {'month':>13} "
        f"{'paused':>6} {'suppr':>5}",
        f"{'acme':16} {7:>7} {2:>6} {4:>8} {hour:>9} {month:>13} {'no':>6} {1:>5}",
        "  paused classes: otp",
        f"  user acme-app: hour 2/5, month 2/{acme_caps.monthly}",
        f"{'globex':16} {0:>7} {0:>6} {0:>8} {ghour:>9} {gmonth:>13} {'yes':>6} {0:>5}",
        "provider local on i1: circuit open since 2023-11-14T22:13:20Z; NOT READY (connect refused)",
        "provider local: throttled (rate-limit reply) until 2100-01-01T00:00:00Z",
        "zone globex: own route local",
    ]
    # One zone: only its row, the providers still in full.
    code, out, _ = cli(capsys, path, "stats", "globex", "--json")
    assert code == 0 and [z["zone"] for z in json.loads(out)["zones"]] == ["globex"]


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream) -> AsyncIterator[Server]:
    async with running_guard(console_config(tmp, upstream)) as server:
        yield server


@pytest.fixture
async def alice(guard: Server) -> AsyncIterator[Operator]:
    op = Operator(console_port(guard))
    assert (await op.login("alice")).status == 200
    yield op
    await op.close()


async def test_console_zone_operations_show_and_audit_as_the_console_user(
    guard: Server, alice: Operator
) -> None:
    store = guard.store
    assert store is not None
    now = store.now()
    zc = guard.config.zones["acme"]
    caps = caps_for(zc.plan, zc.hourly_cap, zc.monthly_cap)
    check = CapCheck("acme", caps, now - 3600, month_of(now), "t0", now)
    assert await store.consume_cap(check) is None
    await store.set_class_paused("acme", "otp", True)
    assert (await alice.post("/zones/globex/pause", {})).status == 200
    rows = await views.zones(guard.config, store)
    assert [
        (r.name, r.counts, r.hour, r.month, r.paused, r.paused_by_config, r.paused_classes) for r in rows
    ] == [
        ("acme", {}, views.Bar(1, caps.hourly), views.Bar(1, caps.monthly), False, False, ("otp",)),
        (
            "globex",
            {},
            views.Bar(0, caps_for("solo", None, None).hourly),
            views.Bar(0, caps_for("solo", None, None).monthly),
            True,
            False,
            (),
        ),
    ]
    page = (await alice.get("/")).text
    assert f"1/{caps.hourly}" in page and 'data-paused-class="otp"' in page
    assert (await alice.post("/zones/globex/resume", {})).status == 200
    assert not await store.is_paused("globex")
    # No reason given: the console names its user; adding twice is audited twice.
    for _ in range(2):
        assert (await alice.post("/suppression/acme/add", {"address": "Gone@Example.NET"})).status == 200
    listed = await store.suppress_list("acme")
    assert [(e.address, e.reason) for e in listed] == [("gone@example.net", "added by console:alice")]
    assert now - 5 <= listed[0].at <= store.now()
    assert (await alice.post("/suppression/acme/remove", {"address": "gone@example.net"})).status == 200
    # Already gone (the list is folded to lower case): nothing to audit.
    assert (await alice.post("/suppression/acme/remove", {"address": "Gone@example.net"})).status == 200
    assert (
        await alice.post("/suppression/global/add", {"address": "all@example.org", "reason": "r"})
    ).status == 200
    assert [(e.address, e.reason) for e in await store.suppress_list("global")] == [("all@example.org", "r")]
    assert await store.suppress_list("acme") == []
    log = await store.audit_log("acme", 0) + await store.audit_log("globex", 0)
    assert sorted((e.actor, e.action, e.key, e.note) for e in log) == sorted(
        [
            ("console:alice", "suppress:add", "Gone@example.net", ""),
            ("console:alice", "suppress:add", "Gone@example.net", ""),
            ("console:alice", "suppress:remove", "gone@example.net", ""),
            ("console:alice", "pause", "", ""),
            ("console:alice", "resume", "", ""),
        ]
    )
    assert all(now - 5 <= e.at <= store.now() for e in log)


def test_cli_reads_time_from_the_store_clock_as_the_console_does(
    tmp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's clock (Redis' or PostgreSQL's server time) is the fleet's: the CLI's
    suppression times, cap use and throttles are read at it, not at this machine's."""
    from smtpguard.store.sqlite import SQLiteStore

    path = write_config(tmp / "c.yaml", zone_config(tmp))
    behind = time.time() - 2 * 3600  # the store's clock, two hours behind this machine's
    monkeypatch.setattr(SQLiteStore, "now", lambda self: behind)

    async def seed_at_store_time(store: Store) -> None:
        zc = load(str(path)).zones["globex"]
        caps = caps_for(zc.plan, zc.hourly_cap, zc.monthly_cap)
        assert (
            await store.consume_cap(CapCheck("globex", caps, behind - 3600, month_of(behind), "t", behind))
            is None
        )
        await store.set_throttled("local", behind + 60)

    with_store(tmp, seed_at_store_time)
    assert cli(capsys, path, "suppress", "add", "acme", "a@example.com")[0] == 0
    listed = with_store(tmp, lambda s: s.suppress_list("acme"))
    assert [e.at for e in listed] == [behind]
    code, out, err = cli(capsys, path, "stats", "globex", "--json")
    assert code == 0, err
    doc = json.loads(out)
    # At the store's time the unit is within the hour and the throttle still on.
    assert doc["zones"][0]["cap"]["hour"]["used"] == 1
    assert list(doc["throttled"]) == ["local"]
