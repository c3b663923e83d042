"""Receiving providers (DESIGN.md §21) end to end: a real DNS server (NSD) serving MX records
of each kind, a real listener, a real SMTP client and a recording upstream; sends and events
counted per receiver, a receiver's max_rate and pause refusing only its recipients at RCPT,
and DNS trouble that counts as `other` and never holds mail up."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from smtpguard import desk
from smtpguard.cli import main
from smtpguard.metrics import Metrics
from smtpguard.policy.receivers import control_name, slow_control
from tests.support import (
    FakeClock,
    RedisServer,
    Upstream,
    base_config,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support import events as ev
from tests.support.console import Operator, console_config, console_port
from tests.support.dns import NsdServer, bad_resolver, nsd
from tests.support.eventually import eventually

RECORDS = [
    "gm IN MX 5 aspmx.l.google.com.",
    "gm IN MX 10 alt1.aspmx.l.google.com.",
    "ms IN MX 10 ms-test.mail.protection.outlook.com.",
    "yh IN MX 1 mta5.am0.yahoodns.net.",
    "ap IN MX 10 mx01.mail.icloud.com.",
    # No MX: the domain itself is matched (here by the config's own `corp` receiver).
    "corp IN A 192.0.2.2",
    "plain IN MX 10 mx.hosting.example.",
    # A suffix matches whole labels: notgoogle.com is not google.com.
    "fake IN MX 10 mx.notgoogle.com.",
]

RCPTS = {
    "gmail": "a@gm.test",
    "microsoft": "b@ms.test",
    "yahoo": "c@yh.test",
    "apple": "d@ap.test",
    "corp": "e@corp.test",
    "other": "f@plain.test",
}


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsdServer]:
    with nsd(tmp_path_factory.mktemp("dns"), "test", RECORDS, ttl=300, negative=60) as server:
        yield server


def receiving_config(tmp: Path, upstream: Upstream, nameserver: str, **more: Any) -> dict[str, Any]:
    cfg = base_config(tmp, upstream.port, **more)
    cfg["dns"] = {"nameservers": [nameserver], "timeout": "2s"}
    cfg["receivers"] = {"corp": ["corp.test"]}
    return cfg


def sends(metrics: Metrics, zone: str, receiver: str) -> float:
    return float(metrics.receiver_sends.labels(zone, receiver)._value.get())


def events_of(metrics: Metrics, zone: str, receiver: str, kind: str) -> float:
    return float(metrics.receiver_events.labels(zone, receiver, kind)._value.get())


async def test_sends_are_counted_per_receiver(
    tmp: Path, upstream: Upstream, dns_server: NsdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = receiving_config(tmp, upstream, dns_server.nameserver)
    path = tmp / "smtpguard.yaml"
    async with running_guard(cfg, config_path=path) as guard:
        recipients = [*RCPTS.values(), "g@fake.test"]
        reply = await send(guard.ports[0], message("k1"), recipients=recipients)
        assert reply.code == 250, reply
        await upstream.wait_received(1)
        assert upstream.received[0].rcpt_tos == recipients
        assert len(upstream.received) == 1
        counted = {r: sends(guard.metrics, "acme", r) for r in RCPTS}
        assert counted == {"gmail": 1, "microsoft": 1, "yahoo": 1, "apple": 1, "corp": 1, "other": 2}
        assert (
            'smtpguard_receiver_sends_total{receiver="gmail",zone="acme"} 1.0'
            in guard.metrics.render().decode()
        )
        # A duplicate of the delivered event sends nothing and counts nothing.
        assert (await send(guard.ports[0], message("k1"), recipients=recipients)).code == 250
        assert len(upstream.received) == 1
        assert sends(guard.metrics, "acme", "gmail") == 1
        # One MX lookup per domain: the count after DATA is served from RCPT's cache.
        receivers = guard.assembly.receivers
        assert receivers is not None and receivers.lookup.lookups == len(recipients)
        # `stats` reads the fleet's counters from the store once they are flushed.
        assert guard.store is not None
        store = guard.store
        await eventually(
            lambda: store.counts("acme"),
            lambda c: c.get("receiver:other:sent") == 2,
            timeout=10,
            interval=0.1,
        )
        assert await asyncio.to_thread(main, ["stats", "acme", "--json", "-c", str(path)]) == 0
        row = json.loads(capsys.readouterr().out)["zones"][0]
        assert row["receivers"]["gmail"]["sent"] == 1 and row["receivers"]["other"]["sent"] == 2
        assert await asyncio.to_thread(main, ["stats", "acme", "-c", str(path)]) == 0
        assert "receiver microsoft: sent 1, delivered 0" in capsys.readouterr().out


def _instance(tmp: Path, upstream: Upstream, nameserver: str, url: str, name: str) -> dict[str, Any]:
    cfg = receiving_config(tmp, upstream, nameserver, store__url=url, store__unsafe=True)
    cfg["instance"] = name
    # One microsoft recipient a minute, fleet-wide: the second within the test is over it.
    cfg["zones"]["acme"]["receivers"] = {"microsoft": {"max_rate": "1/m"}}
    return cfg


async def test_max_rate_refuses_only_its_receivers_recipients_on_two_instances(
    tmp: Path, upstream: Upstream, dns_server: NsdServer, redis_server: RedisServer
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/11"
    plain = redis.Redis.from_url(url)
    plain.flushdb()
    try:
        one = _instance(tmp, upstream, dns_server.nameserver, url, "i1")
        two = _instance(tmp, upstream, dns_server.nameserver, url, "i2")
        async with running_guard(one) as a, running_guard(two) as b:
            first = await send(a.ports[0], message("k1"), recipients=["m1@ms.test", "g1@gm.test"])
            assert first.code == 250, first
            second = await send(b.ports[0], message("k2"), recipients=["m2@ms.test", "g2@gm.test"])
            # The helper reports the refused recipient; the message went to the other.
            assert second.code == 451 and second.text.startswith("4.7.1"), second
            assert "microsoft" in second.text
            await upstream.wait_received(2)
            assert [r.rcpt_tos for r in upstream.received] == [["m1@ms.test", "g1@gm.test"], ["g2@gm.test"]]
            # Through the first instance again: the slot is the fleet's, not the instance's.
            third = await send(a.ports[0], message("k3"), recipients=["m3@ms.test"])
            assert third.code == 451 and third.text.startswith("4.7.1"), third
            assert len(upstream.received) == 2
            assert sends(a.metrics, "acme", "microsoft") + sends(b.metrics, "acme", "microsoft") == 1
            assert sends(b.metrics, "acme", "gmail") == 1
    finally:
        plain.flushdb()
        plain.close()


async def test_pause_and_resume_by_the_cli_reach_a_running_serve(
    tmp: Path, upstream: Upstream, dns_server: NsdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = receiving_config(tmp, upstream, dns_server.nameserver)
    path = tmp / "smtpguard.yaml"
    async with running_guard(cfg, config_path=path) as guard:
        port = guard.ports[0]
        assert await asyncio.to_thread(main, ["pause", "acme", "--receiver", "yahoo", "-c", str(path)]) == 0
        assert "receiver yahoo of zone acme paused" in capsys.readouterr().out
        n = iter(range(100))

        async def to_yahoo() -> Any:
            return await send(port, message(f"y{next(n)}"), recipients=["y@yh.test", "g@gm.test"])

        held = await eventually(to_yahoo, lambda r: r.code == 451, timeout=5, interval=0.1)
        assert held.code == 451 and held.text.startswith("4.7.1") and "paused" in held.text, held
        # The gmail recipient of the same transaction went through, and nothing to yahoo.
        assert all("y@yh.test" not in r.rcpt_tos for r in upstream.received[-1:])
        assert upstream.received[-1].rcpt_tos == ["g@gm.test"]
        assert await asyncio.to_thread(main, ["resume", "acme", "--receiver", "yahoo", "-c", str(path)]) == 0
        back = await eventually(to_yahoo, lambda r: r.code == 250, timeout=5, interval=0.1)
        assert back.code == 250, back
        assert upstream.received[-1].rcpt_tos == ["y@yh.test", "g@gm.test"]
        assert guard.store is not None
        audit = [(e.action, e.key) for e in await guard.store.audit_log("acme", 0)]
        assert ("pause:receiver", "yahoo") in audit and ("resume:receiver", "yahoo") in audit
        assert await guard.store.paused_classes() == set()
        # Unknown receiver names are a usage error naming the known ones.
        assert main(["pause", "acme", "--receiver", "aol", "-c", str(path)]) == 2
        assert "unknown receiver 'aol'" in capsys.readouterr().err


async def test_a_receiver_paused_in_config_holds_its_recipients(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    cfg = receiving_config(tmp, upstream, dns_server.nameserver)
    cfg["zones"]["acme"]["receivers"] = {"yahoo": {"paused": True}}
    async with running_guard(cfg) as guard:
        only = await send(guard.ports[0], message("k1"), recipients=["y@yh.test"])
        assert only.code == 451 and only.text.startswith("4.7.1"), only
        both = await send(guard.ports[0], message("k2"), recipients=["y@yh.test", "m@ms.test"])
        assert both.code == 451, both
        await upstream.wait_received(1)
        assert [r.rcpt_tos for r in upstream.received] == [["m@ms.test"]]


async def test_queue_mode_holds_a_paused_receivers_entry_until_resumed(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    cfg = receiving_config(tmp, upstream, dns_server.nameserver, zones__acme__delivery="queue")
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        await guard.store.set_class_paused("acme", control_name("yahoo"), True)
        receivers = guard.assembly.receivers
        assert receivers is not None
        await receivers.gate.pauses.paused()  # the copy every RCPT reads, fresh
        queued = await send(guard.ports[0], message("k1"), recipients=["y@yh.test"])
        assert queued.code == 250 and "queued" in queued.text, queued
        other = await send(guard.ports[0], message("k2"), recipients=["g@gm.test"])
        assert other.code == 250, other
        # The gmail entry goes; the yahoo one waits in the lane, nothing sent for it.
        await upstream.wait_received(1)
        assert upstream.received[0].rcpt_tos == ["g@gm.test"]
        rec = await guard.store.get("acme", "k1")
        assert rec is not None and rec.state.value == "queued"
        # Resumed as the CLI does it: the held entry is woken, not left for its 30 s hold.
        await desk.set_receiver_paused(guard.store, "acme", "yahoo", False, "cli:test")
        await upstream.wait_received(2, timeout=10)
        assert [r.rcpt_tos for r in upstream.received] == [["g@gm.test"], ["y@yh.test"]]


async def test_provider_events_are_counted_per_receiver(
    tmp: Path,
    upstream: Upstream,
    dns_server: NsdServer,
    keys: ev.Keys,
) -> None:
    cfg = receiving_config(tmp, upstream, dns_server.nameserver)
    cfg["events"] = {"address": "127.0.0.1:0", "sources": {"mailgun": keys.sources()["mailgun"]}}
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], message("k1"), recipients=["m@ms.test"])).code == 250
        assert (await send(guard.ports[0], message("k2"), recipients=["g@gm.test"])).code == 250
        await upstream.wait_received(2)
        ms_id, gm_id = (r.header("Message-ID") for r in upstream.received)
        assert guard.events is not None
        port = guard.events.port
        bounce = ev.mailgun(keys, ev.mailgun_event("failed", "m@ms.test", ms_id, severity="permanent"))
        complaint = ev.mailgun(keys, ev.mailgun_event("complained", "g@gm.test", gm_id))
        delivered = ev.mailgun(keys, ev.mailgun_event("delivered", "g@gm.test", gm_id))
        for signed in (bounce, complaint, delivered, bounce):  # the bounce twice: applied once
            status, _ = await ev.post(port, "mailgun", signed)
            assert status == 200
        got = {
            (r, k): events_of(guard.metrics, "acme", r, k)
            for r, k in (("microsoft", "bounce"), ("gmail", "complaint"), ("gmail", "delivered"))
        }
        assert got == {("microsoft", "bounce"): 1, ("gmail", "complaint"): 1, ("gmail", "delivered"): 1}
        assert events_of(guard.metrics, "acme", "gmail", "bounce") == 0
        assert len(upstream.received) == 2


async def test_dns_down_counts_other_and_mail_flows(tmp: Path, upstream: Upstream) -> None:
    with bad_resolver(silent=True) as resolver:
        cfg = base_config(tmp, upstream.port)
        cfg["dns"] = {"nameservers": [resolver.nameserver], "timeout": "300ms"}
        cfg["receivers"] = {}
        cfg["zones"]["acme"]["receivers"] = {"gmail": {"max_rate": "1/h"}, "other": {"paused": False}}
        async with running_guard(cfg) as guard:
            receivers = guard.assembly.receivers
            assert receivers is not None
            # The RCPT's wait is the resolver's lifetime, set from dns.timeout.
            assert receivers.lookup.dns.timeout == 0.3
            assert receivers.lookup.dns._resolver.lifetime == 0.3
            for key in ("k1", "k2"):
                reply = await send(guard.ports[0], message(key), recipients=["a@gm.test", "b@gm.test"])
                assert reply.code == 250, reply
            await upstream.wait_received(2)
            assert [r.rcpt_tos for r in upstream.received] == [["a@gm.test", "b@gm.test"]] * 2
            assert resolver.queries >= 1
            # Timed out once, then `other` from the cache for TROUBLE_TTL: one lookup.
            assert receivers.lookup.lookups == 1 and receivers.lookup.troubles == 1
            assert sends(guard.metrics, "acme", "other") == 4
            assert sends(guard.metrics, "acme", "gmail") == 0


ZR = "zones.acme.receivers."


@pytest.mark.parametrize(
    ("where", "value", "expected"),
    [
        (
            ("zones", "acme", "receivers", "microsoft", "max_rate"),
            "5/q",
            "zones.acme.receivers.microsoft.max_rate (line",
        ),
        (("zones", "acme", "receivers", "yahoo", "paused"), "yes", "zones.acme.receivers.yahoo.paused (line"),
        (("zones", "acme", "receivers", "aol"), {"paused": True}, "zones.acme.receivers.aol (line"),
        (
            ("zones", "acme", "receivers", "gmail", "alert", "complaint_rate"),
            "2 percent",
            "complaint_rate (line",
        ),
        (("receivers", "microsoft"), "outlook.com", "receivers.microsoft (line"),
        (("receivers", "microsoft", "max_rate"), "5/s", "go under zones.ZONE.receivers"),
        (("receivers", "Other"), ["x.example"], "receivers.Other (line"),
    ],
    ids=[
        "max_rate",
        "paused",
        "unknown-receiver",
        "share",
        "suffixes-not-a-list",
        "shaping-at-top",
        "bad-name",
    ],
)
def test_bad_receiver_settings_name_their_path_and_line(
    tmp: Path, where: tuple[str, ...], value: Any, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, 2525)
    node = cfg
    for part in where[:-1]:
        node = node.setdefault(part, {})
    node[where[-1]] = value
    path = write_config(tmp / "bad.yaml", cfg)
    assert main(["check-config", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    assert expected in err, err


async def test_an_alert_warns_once_per_window_and_sets_its_gauge(
    tmp: Path, upstream: Upstream, dns_server: NsdServer, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = receiving_config(tmp, upstream, dns_server.nameserver)
    alert = {"complaint_rate": "50%", "window": "1h", "min_sends": 1}  # a few sends suffice here
    cfg["zones"]["acme"]["receivers"] = {"gmail": {"alert": alert}}
    clock = FakeClock()
    clock.t = (clock.t // 3600) * 3600 + 60  # a minute into a window
    caplog.set_level(logging.WARNING, "smtpguard.receivers")

    def warnings() -> int:
        return sum(
            1
            for r in caplog.records
            if r.name == "smtpguard.receivers" and "complaint_rate" in r.getMessage()
        )

    def gauge(guard: Any) -> float:
        return float(guard.metrics.receiver_alert.labels("acme", "gmail", "complaint_rate")._value.get())

    async with running_guard(cfg, clock=clock) as guard:
        assert guard.store is not None and guard.assembly.receivers is not None
        store, alerts = guard.store, guard.assembly.receivers.alerts
        n = iter(range(100))

        async def two_sends() -> None:
            for _ in range(2):
                assert (
                    await send(guard.ports[0], message(f"k{next(n)}"), recipients=["g@gm.test"])
                ).code == 250

        async def judged(sent: int, complaints: int) -> None:
            """Once the fleet's counters (flushed each second) show these totals, judge them
            (serve's own judging every 5 s may come first: the warnings say what happened)."""

            def totals(c: dict[str, int]) -> tuple[int, int]:
                return c.get("receiver:gmail:sent", 0), c.get("receiver:gmail:complaint", 0)

            counts = await eventually(
                lambda: store.counts("acme"),
                lambda c: totals(c) == (sent, complaints),
                timeout=10,
                interval=0.05,
            )
            assert totals(counts) == (sent, complaints)
            await alerts.refresh()

        await judged(0, 0)  # the window's first reading: counting starts here
        assert warnings() == 0
        await two_sends()
        # The one function the events applier calls: 1 complaint in 2 sends is 50%.
        guard._receiver_event("acme", "g@gm.test", "complaint")
        await judged(2, 1)
        assert warnings() == 1 and gauge(guard) == 1
        guard._receiver_event("acme", "g@gm.test", "complaint")
        await two_sends()
        await judged(4, 2)  # the same window, still crossed: no second warning
        assert warnings() == 1 and gauge(guard) == 1
        clock.t += 3600  # the next window: counted from the last reading of this one
        await judged(4, 2)
        assert gauge(guard) == 0 and warnings() == 1
        await two_sends()
        guard._receiver_event("acme", "g@gm.test", "complaint")
        await judged(6, 3)
        assert warnings() == 2 and gauge(guard) == 1
        assert len(upstream.received) == 6


async def test_queue_mode_waits_for_a_receivers_max_rate(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    cfg = receiving_config(tmp, upstream, dns_server.nameserver, zones__acme__delivery="queue")
    cfg["zones"]["acme"]["receivers"] = {"microsoft": {"max_rate": "1/m"}}
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        store = guard.store
        for key, rcpt in (("k1", "m1@ms.test"), ("k2", "m2@ms.test")):
            reply = await send(guard.ports[0], message(key), recipients=[rcpt])
            assert reply.code == 250 and "queued" in reply.text, reply  # accepted, not 451
        await upstream.wait_received(1)

        async def second() -> Any:
            return await store.get("acme", "k2")

        # The second entry is given back to its lane until the receiver's next slot (~1 min).
        held = await eventually(
            second,
            lambda r: (
                r is not None and r.next_attempt_at is not None and r.next_attempt_at > store.now() + 30
            ),
            timeout=10,
            interval=0.1,
        )
        assert held is not None and held.state.value == "queued" and held.attempts == ()
        assert held.next_attempt_at is not None and held.next_attempt_at > store.now() + 30
        assert [r.rcpt_tos for r in upstream.received] == [["m1@ms.test"]]


async def test_on_alert_pause_holds_the_receiver_through_the_store(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    cfg = receiving_config(tmp, upstream, dns_server.nameserver)
    alert = {"complaint_rate": "50%", "window": "1h", "min_sends": 1}
    cfg["zones"]["acme"]["receivers"] = {
        "gmail": {"alert": alert, "on_alert": "pause"},
        "microsoft": {"alert": alert, "on_alert": "slow", "max_rate": "10/s"},
    }
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        store = guard.store
        assert (await send(guard.ports[0], message("k1"), recipients=["g@gm.test", "m@ms.test"])).code == 250
        guard._receiver_event("acme", "g@gm.test", "complaint")
        guard._receiver_event("acme", "m@ms.test", "complaint")
        receivers = guard.assembly.receivers
        assert receivers is not None
        # Judged from the fleet's counters: the first reading starts the window's count.
        await receivers.alerts.refresh()
        assert (await send(guard.ports[0], message("k1b"), recipients=["g@gm.test", "m@ms.test"])).code == 250
        guard._receiver_event("acme", "g@gm.test", "complaint")
        guard._receiver_event("acme", "m@ms.test", "complaint")
        counted = await eventually(
            lambda: store.counts("acme"),
            lambda c: c.get("receiver:microsoft:complaint") == 2,
            timeout=10,
            interval=0.05,
        )
        assert counted.get("receiver:gmail:complaint") == 2
        await receivers.alerts.refresh()
        pairs = await eventually(store.paused_classes, lambda p: len(p) == 2, timeout=5, interval=0.05)
        # `slow` halves microsoft's rate in every worker while its window lasts (a control
        # beside the pause, not a pause: microsoft's recipients still go).
        assert pairs == {("acme", control_name("gmail")), ("acme", slow_control("microsoft"))}
        audit = [(a.actor, a.action, a.key) for a in await store.audit_log("acme", 0)]
        assert sorted(audit) == [
            ("alert", "pause:receiver", "gmail"),
            ("alert", "slow:receiver", "microsoft"),
        ]
        assert desk.split_controls(pairs, "acme") == ([], ["gmail"])
        # This instance's copy of the controls is at most half a second old.
        seen = await eventually(lambda: receivers.gate.paused("acme", "gmail"), timeout=5, interval=0.05)
        assert seen
        held = await send(guard.ports[0], message("k2"), recipients=["g@gm.test"])
        assert held.code == 451 and held.text.startswith("4.7.1"), held
        assert len(upstream.received) == 2


async def test_a_reload_turns_receivers_on_and_changes_their_settings(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    cfg = base_config(tmp, upstream.port)
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    path = tmp / "smtpguard.yaml"
    async with running_guard(cfg, config_path=path) as guard:
        assert guard.handler is not None and guard.handler.receivers is None  # off: no lookups
        assert (await send(guard.ports[0], message("k1"), recipients=["y@yh.test"])).code == 250
        cfg["zones"]["acme"]["receivers"] = {"yahoo": {"paused": True}}
        write_config(path, cfg)
        assert await guard.reload()
        first = guard.handler.receivers
        assert first is not None and guard.worker is not None and guard.worker.receivers is first
        held = await send(guard.ports[0], message("k2"), recipients=["y@yh.test"])
        assert held.code == 451 and held.text.startswith("4.7.1"), held
        cfg["zones"]["acme"]["receivers"] = {"yahoo": {"paused": False}}
        write_config(path, cfg)
        assert await guard.reload()
        assert guard.handler.receivers is first  # kept: its MX cache and alert windows stay
        assert (await send(guard.ports[0], message("k3"), recipients=["y@yh.test"])).code == 250
        await upstream.wait_received(2)
        assert [r.rcpt_tos for r in upstream.received] == [["y@yh.test"], ["y@yh.test"]]
        assert sends(guard.metrics, "acme", "yahoo") == 1  # counted once watching was on


async def test_the_console_shows_each_zones_receivers(
    tmp: Path, upstream: Upstream, dns_server: NsdServer
) -> None:
    cfg = console_config(tmp, upstream)
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    cfg["zones"]["acme"]["receivers"] = {"yahoo": {"paused": True}}
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], message("k1"), recipients=["g@gm.test", "m@ms.test"])).code == 250
        assert guard.store is not None
        store = guard.store
        flushed = await eventually(
            lambda: store.counts("acme"), lambda c: "receiver:gmail:sent" in c, timeout=10, interval=0.1
        )
        assert flushed["receiver:gmail:sent"] == 1
        alice = Operator(console_port(guard))
        try:
            assert (await alice.login("alice")).status == 200
            page = (await alice.get("/")).text
        finally:
            await alice.close()
        assert 'data-receivers="acme"' in page and 'data-receivers="globex"' not in page
        assert re.search(r'data-receiver="gmail">.*?data-count="sent">1<', page, re.S)
        assert re.search(r'data-receiver="microsoft">.*?data-count="sent">1<', page, re.S)
        assert 'data-paused-receiver="yahoo"' in page
