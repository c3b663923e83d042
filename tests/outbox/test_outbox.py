"""The outbox (DESIGN.md §20) end to end: rows committed in a real PostgreSQL by the
application, read by an in-process smtpguard, relayed to a recording upstream, counted."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

from smtpguard.server import Server
from tests.support import Upstream, eventually, running_guard, send
from tests.support.outbox import app_database, insert, open_states, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


def reader_of(server: Server):  # type: ignore[no-untyped-def]
    (reader,) = server.outbox
    return reader


async def settled(url: str, n: int, timeout: float = 20) -> dict[str, dict[str, object]]:
    found = await eventually(
        lambda: receipts(url), lambda f: len(f) == n and not open_states(f), timeout=timeout, interval=0.05
    )
    return found


async def test_a_committed_row_is_sent_once_with_its_receipt(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        await insert(url, [row("invoice:acme:1")])
        found = await settled(url, 1)
    r = found["invoice:acme:1"]
    assert r["state"] == "sent"
    assert str(r["reply"]).startswith("250 2.0.0 [sg:")
    assert r["sg_id"] and r["upstream_id"] == "Q1"
    assert r["attempts"] == 1 and r["done_at"] is not None and r["next_attempt_at"] is None
    assert upstream.event_keys() == ["invoice:acme:1"]
    # Bare LFs from as_bytes() went out as CRLF lines, not refused as smuggling.
    assert b"\r\nSubject: Invoice 1\r\n" in upstream.received[0].content


async def test_a_rolled_back_row_is_never_sent(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        await insert(url, [row("order:rolled-back")], commit=False)
        await insert(url, [row("order:committed")])
        # The committed row, inserted after, is the positive event the negative waits on.
        found = await settled(url, 1)
    assert list(found) == ["order:committed"]
    assert upstream.event_keys() == ["order:committed"]


async def test_a_key_already_sent_by_smtp_ends_duplicate(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from tests.support import message

    url = app_database(postgres_server)
    async with running_guard(outbox_config(tmp, upstream.port, url)) as server:
        reply = await send(server.ports[0], message("invoice:acme:7"))
        assert reply.code == 250
        await insert(url, [row("invoice:acme:7")])
        found = await settled(url, 1)
    r = found["invoice:acme:7"]
    assert r["state"] == "duplicate"
    assert "duplicate" in str(r["reply"])
    assert upstream.event_keys() == ["invoice:acme:7"]


async def test_poison_rows_fail_naming_the_problem_and_never_block_the_rows_after_them(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url, batch=2)
    cfg["limits"] = {"max_message_size": 2000}
    good = [row(f"good:{i}") for i in range(4)]
    poison = [
        replace(row("poison:unparsable"), message=b"this is not a message\njust text\n"),
        replace(row("poison:nul"), message=b"Subject: a NUL\n\nbody\x00\n"),
        row("poison:bad-address", rcpt_to=("no-at-sign",)),
        row("poison:unmapped", mail_from="ceo@elsewhere.example"),
        row("poison:oversize", body="x" * 3000),
        row("poison:header-from", header_from="other@elsewhere.example"),
        row("poison:no-rcpt", rcpt_to=()),
    ]
    async with running_guard(cfg):
        await insert(url, [*poison[:3], good[0], *poison[3:], *good[1:]])
        found = await settled(url, 11)
    assert {k: found[k]["state"] for k in found if k.startswith("good:")} == dict.fromkeys(
        (g.event_key for g in good), "sent"
    )
    assert Counter(upstream.event_keys()) == Counter(g.event_key for g in good)
    replies = {k: str(found[k]["reply"]) for k in found if k.startswith("poison:")}
    assert all(found[k]["state"] == "failed" for k in replies), replies
    assert "header line without a field name" in replies["poison:unparsable"]
    assert replies["poison:nul"].startswith("550 5.5.2")
    assert replies["poison:bad-address"].startswith("5") and "recipient" in replies["poison:bad-address"]
    assert (
        replies["poison:unmapped"].startswith("550 5.7.1")
        and "ceo@elsewhere.example" in replies["poison:unmapped"]
    )
    assert replies["poison:oversize"].startswith("552 5.3.4")
    assert replies["poison:header-from"].startswith("550 5.7.1")
    assert replies["poison:no-rcpt"].startswith("554 5.5.1")


async def test_a_4xx_is_retried_after_backoff_then_sent(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from tests.support import Behaviour, FakeClock

    url = app_database(postgres_server)
    clock = FakeClock()
    upstream.handler.script = [Behaviour(data="451 4.3.0 upstream busy, try later")]
    async with running_guard(outbox_config(tmp, upstream.port, url), clock=clock) as server:
        await insert(url, [row("invoice:acme:451")])
        first = await eventually(
            lambda: receipts(url), lambda f: str(f["invoice:acme:451"]["reply"]).startswith("451"),
            timeout=10, interval=0.05,
        )  # fmt: skip
        r = first["invoice:acme:451"]
        assert r["state"] == "pending" and r["attempts"] == 1
        # Backoff with jitter, never sooner than min_retry_interval (60s in the test config).
        wait = r["next_attempt_at"].timestamp() - clock.t  # type: ignore[union-attr]
        assert 60 - 1 <= wait <= 3 * 86400
        passes = reader_of(server).counters.passes
        await eventually(
            lambda: reader_of(server).counters.passes, lambda n: n >= passes + 3, timeout=10, interval=0.05
        )
        assert upstream.handler.data_commands == 1  # not due yet: nothing tried again
        clock.t += wait + 1
        reader_of(server).wake()
        found = await settled(url, 1)
    assert found["invoice:acme:451"]["state"] == "sent"
    assert found["invoice:acme:451"]["attempts"] == 2
    assert upstream.event_keys() == ["invoice:acme:451"]
    assert upstream.handler.data_commands == 2


async def test_caps_and_pause_hold_rows_pending(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url, batch=1)
    cfg["zones"]["acme"]["hourly_cap"] = 1
    async with running_guard(cfg):
        await insert(url, [row("capped:1"), row("capped:2")])
        found = await eventually(
            lambda: receipts(url), lambda f: all(r["reply"] for r in f.values()), timeout=10, interval=0.05
        )
    assert found["capped:1"]["state"] == "sent"
    assert found["capped:2"]["state"] == "pending" and str(found["capped:2"]["reply"]).startswith("451 4.7.0")
    assert found["capped:2"]["next_attempt_at"] is not None
    assert upstream.event_keys() == ["capped:1"]

    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url)
    cfg["zones"]["acme"]["paused"] = True
    async with running_guard(cfg):
        await insert(url, [row("paused:1")])
        found = await eventually(
            lambda: receipts(url), lambda f: f["paused:1"]["reply"] is not None, timeout=10, interval=0.05
        )
    assert found["paused:1"]["state"] == "pending"
    assert str(found["paused:1"]["reply"]).startswith("451 4.7.0") and "paused" in str(
        found["paused:1"]["reply"]
    )
    assert upstream.event_keys() == ["capped:1"]


async def test_a_notification_wakes_the_reader_long_before_its_poll(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    async with running_guard(outbox_config(tmp, upstream.port, url, poll="30s")) as server:
        reader = reader_of(server)
        await eventually(lambda: reader.counters.passes, lambda n: n >= 1, timeout=10, interval=0.02)
        await insert(url, [row("notify:1")])
        found = await settled(url, 1, timeout=10)
        # Sent by a pass a notification started: no 30 s poll has run out yet.
        assert reader.counters.polls == 0
        assert reader.counters.notified >= 1
    assert found["notify:1"]["state"] == "sent"
    assert upstream.event_keys() == ["notify:1"]


async def test_a_held_row_follows_its_record_once_an_operator_settles_it(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from smtpguard import desk
    from tests.support import Behaviour, FakeClock

    url = app_database(postgres_server)
    clock = FakeClock()
    # The message reaches the provider and the reply never comes: the outcome is unknown.
    # The second is refused at MAIL: it never reached DATA, so it is pending, never held.
    upstream.handler.script = [Behaviour(drop_after_dot=True), Behaviour(mail="451 4.3.0 not now")]
    async with running_guard(outbox_config(tmp, upstream.port, url, batch=1), clock=clock) as server:
        await insert(url, [row("held:1"), row("never-data:1", rcpt_to=("a@example.com",))])
        held = await eventually(
            lambda: receipts(url), lambda f: all(r["reply"] for r in f.values()), timeout=15, interval=0.05
        )
        assert held["held:1"]["state"] == "held" and str(held["held:1"]["reply"]).startswith("451 4.3.0")
        assert held["never-data:1"]["state"] == "pending"
        assert str(held["never-data:1"]["reply"]).startswith("451")
        assert upstream.event_keys().count("held:1") == 1
        # Looked at again while its record is still unknown: held, its reply kept.
        reader = reader_of(server)
        clock.t += 61
        passes = reader.counters.passes
        reader.wake()
        await eventually(lambda: reader.counters.passes, lambda n: n >= passes + 2, timeout=10, interval=0.05)
        again = (await receipts(url))["held:1"]
        assert again["state"] == "held" and again["reply"] == held["held:1"]["reply"]
        assert again["next_attempt_at"] > held["held:1"]["next_attempt_at"]  # type: ignore[operator]
        assert server.store is not None
        await desk.decide(server.store, "acme", "held:1", "delivered", "cli:test", None)
        clock.t += 61
        reader_of(server).wake()
        found = await eventually(
            lambda: receipts(url), lambda f: f["held:1"]["state"] == "sent", timeout=10, interval=0.05
        )
    assert found["held:1"]["state"] == "sent" and found["held:1"]["done_at"] is not None
    assert upstream.event_keys().count("held:1") == 1


async def test_the_console_queue_page_and_the_metrics_show_each_outbox(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    import aiohttp

    from tests.support import Behaviour, free_port
    from tests.support.console import Operator, console_config, console_port

    url = app_database(postgres_server)
    cfg = console_config(tmp, upstream)
    cfg["outbox"] = outbox_config(tmp, upstream.port, url, batch=1)["outbox"]
    unreachable = f"postgresql://app@127.0.0.1:{free_port()}/gone"
    cfg["outbox"]["gone"] = {"url": unreachable, "zone": "acme", "user": "acme-app", "poll": "30s"}
    metrics_port = free_port()
    cfg["metrics"] = {"address": f"127.0.0.1:{metrics_port}"}
    upstream.handler.script = [Behaviour(), Behaviour(data="554 5.7.1 refused by policy")]
    async with running_guard(cfg) as server:
        await insert(url, [row("console:1"), row("console:2")])
        await settled(url, 2)
        # The counts are refreshed at most once a second: wait for the metric, bounded.
        async with aiohttp.ClientSession() as http:

            async def scrape() -> str:
                async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as r:
                    return await r.text()

            text = await eventually(
                scrape,
                lambda t: 'smtpguard_outbox_rows{source="shop",state="failed"} 1.0' in t,
                timeout=10,
                interval=0.1,
            )
        assert 'smtpguard_outbox_rows{source="shop",state="sent"} 1.0' in text
        assert 'smtpguard_outbox_rows{source="shop",state="failed"} 1.0' in text
        assert 'smtpguard_outbox_lag_seconds{source="shop"} 0.0' in text
        op = Operator(console_port(server))
        try:
            assert (await op.login("alice")).status == 200
            page = await op.get("/queue")
        finally:
            await op.close()
    assert page.status == 200
    assert (
        "<td>shop</td><td>acme</td><td>smtpguard_outbox</td><td>0</td><td>0</td><td>1</td><td>0</td><td>1</td>"
        in page.text
    )
    assert "<td>gone</td>" in page.text and "unreadable: OperationalError" in page.text


async def test_a_queue_mode_zone_answers_queued_and_the_row_follows_its_record_to_sent(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url)
    cfg["zones"]["acme"]["delivery"] = "queue"
    from tests.support import FakeClock

    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as server:
        await insert(url, [row("queued:1")])
        queued = await eventually(
            lambda: receipts(url), lambda f: f["queued:1"]["reply"] is not None, timeout=10, interval=0.05
        )
        assert str(queued["queued:1"]["reply"]).startswith("250 2.0.0") and "queued" in str(
            queued["queued:1"]["reply"]
        )
        assert queued["queued:1"]["sg_id"]
        await upstream.wait_received(1)
        # The store-and-forward worker delivered it; the row learns so from the record.
        next_look = queued["queued:1"]["next_attempt_at"]
        assert next_look is not None
        clock.t = next_look.timestamp() + 1  # type: ignore[union-attr]
        reader_of(server).wake()
        found = await settled(url, 1)
    r = found["queued:1"]
    assert r["state"] == "sent" and r["upstream_id"] == "Q1"
    assert str(r["reply"]).startswith("250")
    assert upstream.event_keys() == ["queued:1"]
