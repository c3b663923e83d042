"""The outbox attacked from the application's side: locks the application's own
transactions hold, and what the operator's console does meanwhile. Each counts what the
upstream got or what the page answered, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest

from tests.support import Upstream, eventually, running_guard
from tests.support.outbox import app_database, insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def test_the_console_queue_page_answers_while_a_migration_locks_the_outbox_table(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from tests.support.console import Operator, console_config, console_port

    url = app_database(postgres_server)
    cfg = console_config(tmp, upstream)
    cfg["outbox"] = outbox_config(tmp, upstream.port, url)["outbox"]
    async with running_guard(cfg) as server, await psycopg.AsyncConnection.connect(url) as migration:
        # A migration of the application (ALTER TABLE, say) holds the table's strongest lock.
        await migration.execute("LOCK TABLE smtpguard_outbox IN ACCESS EXCLUSIVE MODE")
        op = Operator(console_port(server))
        try:
            assert (await op.login("alice")).status == 200
            page = await asyncio.wait_for(op.get("/queue"), 20)
        finally:
            await op.close()
            await migration.rollback()
    assert page.status == 200
    assert "<td>shop</td>" in page.text and "unreadable:" in page.text
    assert "timeout" in page.text.lower() or "cancel" in page.text.lower(), page.text[-800:]


async def test_a_row_the_application_locks_mid_send_does_not_stall_the_receipts_or_rows_after_it(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from tests.support import Behaviour

    url = app_database(postgres_server)
    # The provider takes the first message, then is slow to answer its final dot.
    upstream.handler.script = [Behaviour(hang_after_dot=1.5)]
    async with (
        running_guard(outbox_config(tmp, upstream.port, url)),
        await psycopg.AsyncConnection.connect(url) as app,
    ):
        await insert(url, [row("locked:1")])
        await upstream.wait_received(1)
        # Meanwhile the application looks at its row in a transaction it keeps open.
        await app.execute("SELECT state FROM smtpguard_outbox WHERE event_key = 'locked:1' FOR UPDATE")
        await insert(url, [row("after:1")])
        try:
            found = await eventually(
                lambda: receipts(url), lambda f: f["after:1"]["state"] == "sent", timeout=15, interval=0.1
            )
            assert found["after:1"]["state"] == "sent", found
            # The locked row's receipt waits for the lock; nothing else does.
            assert found["locked:1"]["state"] == "pending"
        finally:
            await app.rollback()
        found = await eventually(
            lambda: receipts(url), lambda f: f["locked:1"]["state"] == "sent", timeout=15, interval=0.1
        )
    assert found["locked:1"]["state"] == "sent" and found["locked:1"]["attempts"] == 1
    assert upstream.event_keys() == ["locked:1", "after:1"]


async def test_a_reload_that_removes_an_outbox_source_stops_its_reader_and_one_that_adds_it_starts_one(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from tests.support import write_config

    url = app_database(postgres_server)
    other = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url)
    # A second source the reloads leave alone: its rows are the positive events the
    # negative ones wait on.
    cfg["outbox"]["crm"] = {**cfg["outbox"]["shop"], "url": other}
    path = tmp / "smtpguard.yaml"
    async with running_guard(cfg, config_path=path) as server:
        await insert(url, [row("before:1")])
        await eventually(
            lambda: receipts(url), lambda f: f["before:1"]["state"] == "sent", timeout=10, interval=0.05
        )
        kept = next(r for r in server.outbox if r.name == "crm")
        # The operator takes the shop's outbox out of service.
        without = {**cfg, "outbox": {"crm": cfg["outbox"]["crm"]}}
        write_config(path, without)
        assert await server.reload()
        assert server.outbox == [kept]
        await insert(url, [row("while-removed:1")])
        await insert(other, [row("crm:1")])
        await eventually(
            lambda: receipts(other), lambda f: f["crm:1"]["state"] == "sent", timeout=10, interval=0.05
        )
        assert (await receipts(url))["while-removed:1"]["state"] == "pending"
        assert upstream.event_keys() == ["before:1", "crm:1"]
        # Back, now as another user of the zone: a reader of the new source sends the row.
        cfg["zones"]["acme"]["users"].append({**cfg["zones"]["acme"]["users"][0], "username": "acme-shop"})
        cfg["outbox"]["shop"]["user"] = "acme-shop"
        write_config(path, cfg)
        assert await server.reload()
        assert kept in server.outbox and len(server.outbox) == 2
        (reader,) = (r for r in server.outbox if r.name == "shop")
        assert reader.src.user == "acme-shop"
        found = await eventually(
            lambda: receipts(url),
            lambda f: f["while-removed:1"]["state"] == "sent",
            timeout=10,
            interval=0.05,
        )
    assert found["while-removed:1"]["state"] == "sent"
    assert upstream.event_keys() == ["before:1", "crm:1", "while-removed:1"]


async def test_a_row_scheduled_past_its_class_max_age_is_not_expired_at_its_first_4xx(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from tests.support import FakeClock

    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url)
    cfg["zones"]["acme"]["paused"] = True  # its first attempt is answered 451
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as server:
        # A reminder for four days from now: older than the default class's max_age (3 days)
        # by the time it may be sent, but not stale: it was not due before.
        message = row("reminder:1").message
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as app:
            await app.execute(
                "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, not_before) "
                "VALUES ('reminder:1', %s, 'billing@acme.example', ARRAY['customer@example.com'], "
                "now() + interval '4 days')",
                (message,),
            )
        clock.t += 4 * 86400 + 60
        server.outbox[0].wake()
        found = await eventually(
            lambda: receipts(url), lambda f: f["reminder:1"]["reply"] is not None, timeout=10, interval=0.05
        )
    r = found["reminder:1"]
    assert str(r["reply"]).startswith("451 4.7.0"), r
    assert r["state"] == "pending", r
    # Tried again within its class's max_age counted from when it became due.
    assert r["next_attempt_at"].timestamp() > clock.t  # type: ignore[union-attr]
    assert upstream.event_keys() == []


async def test_a_table_named_by_an_sql_keyword_is_made_by_init_and_served(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from smtpguard.cli import main
    from tests.support import write_config
    from tests.support.outbox import new_database

    url = new_database(postgres_server)
    # `order` passes the config's name rule (lower-case letters) and is a reserved word.
    cfg = outbox_config(tmp, upstream.port, url, table="order")
    path = write_config(tmp / "smtpguard.yaml", cfg)
    assert await asyncio.to_thread(main, ["outbox", "init", "-c", str(path), "shop"]) == 0
    async with running_guard(cfg), await psycopg.AsyncConnection.connect(url, autocommit=True) as app:
        await app.execute(
            'INSERT INTO "order" (event_key, message, mail_from, rcpt_to) VALUES (%s, %s, %s, %s)',
            ("keyword:1", row("keyword:1").message, "billing@acme.example", ["customer@example.com"]),
        )

        async def state() -> object:
            cur = await app.execute('SELECT state FROM "order"')
            return (await cur.fetchone() or [None])[0]

        found = await eventually(state, lambda s: s == "sent", timeout=10, interval=0.05)
    assert found == "sent"
    assert upstream.event_keys() == ["keyword:1"]


async def test_a_send_slower_than_the_claim_is_reclaimed_by_the_other_instance_and_sent_once(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from tests.support import Behaviour
    from tests.support.outbox import new_database, pair_configs

    url = app_database(postgres_server)
    store = new_database(postgres_server, "store")
    # The provider takes the message and answers its final dot only once the other instance
    # has claimed the row (its 1 s claim lapsed) and been told the event is in flight: held
    # by an event, not for a guessed time, within a data timeout longer than the test.
    held = asyncio.Event()
    upstream.handler.script = [Behaviour(hold_after_dot=held)]
    configs = pair_configs(tmp, upstream.port, url, store)
    for cfg in configs:
        cfg["event_key"].update({"lease": "1s", "inflight_wait": "0.5s"})
        cfg["providers"][0]["timeouts"]["data"] = "60s"
    async with running_guard(configs[0]) as a, running_guard(configs[1]) as b:
        await insert(url, [row("slow:1")])
        await upstream.wait_received(1)
        # A reader counts a row once its claim's rows are handled: the sender's is not while
        # its final dot is held, so the first count is the other instance's claim.
        other = await eventually(
            lambda: a.outbox[0].counters.rows + b.outbox[0].counters.rows,
            lambda n: n >= 1,
            timeout=30,
            interval=0.05,
        )
        assert other >= 1, "the other instance never claimed the row while it was being sent"
        held.set()
        found = await eventually(
            lambda: receipts(url), lambda f: f["slow:1"]["state"] == "sent", timeout=20, interval=0.1
        )
        claims = a.outbox[0].counters.rows + b.outbox[0].counters.rows
    assert found["slow:1"]["state"] == "sent", found
    assert claims >= 2  # both instances took the row: the claim really lapsed mid-send
    assert upstream.event_keys() == ["slow:1"]
    assert upstream.handler.data_commands == 1


async def test_the_role_the_docs_name_select_and_update_only_serves_and_init_says_what_it_lacks(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    import uuid

    from smtpguard.cli import main
    from tests.support import write_config

    url = app_database(postgres_server)
    role, app = f"sg_{uuid.uuid4().hex[:8]}", f"app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as admin:
        # configuration.md, word for word: smtpguard's role gets SELECT, UPDATE on the table
        # (LISTEN needs nothing); the application's role INSERT and its id sequence's USAGE.
        for statement in (
            f"CREATE ROLE {role} LOGIN",
            f"GRANT SELECT, UPDATE ON smtpguard_outbox TO {role}",
            f"CREATE ROLE {app} LOGIN",
            f"GRANT INSERT ON smtpguard_outbox TO {app}",
            f"GRANT USAGE ON SEQUENCE smtpguard_outbox_id_seq TO {app}",
        ):
            admin.execute(statement)  # type: ignore[arg-type]
    least = url.replace("://postgres@", f"://{role}@")
    app_url = url.replace("://postgres@", f"://{app}@")
    assert least != url != app_url
    cfg = outbox_config(tmp, upstream.port, least)
    path = write_config(tmp / "smtpguard.yaml", cfg)
    assert await asyncio.to_thread(main, ["outbox", "init", "-c", str(path), "shop"]) == 1
    assert "permission denied" in capsys.readouterr().err
    async with running_guard(cfg):
        await insert(app_url, [row("least:1"), row("least:2", rcpt_to=("no-at-sign",))])
        found = await eventually(
            lambda: receipts(url),
            lambda f: all(r["state"] not in ("pending", "held") for r in f.values()),
            timeout=10,
            interval=0.05,
        )
    assert {k: r["state"] for k, r in found.items()} == {"least:1": "sent", "least:2": "failed"}
    assert upstream.event_keys() == ["least:1"]


async def test_a_storm_of_ten_thousand_notifications_costs_a_few_passes_and_rows_still_flow(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    async with running_guard(outbox_config(tmp, upstream.port, url, poll="30s")) as server:
        reader = server.outbox[0]
        await eventually(lambda: reader.counters.passes, lambda n: n >= 1, timeout=10, interval=0.02)
        before = reader.counters.passes
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as app:
            # Distinct payloads: PostgreSQL folds identical ones of one transaction into one.
            await app.execute(
                "SELECT pg_notify('smtpguard_outbox', i::text) FROM generate_series(1, 10000) AS i"
            )
        await eventually(lambda: reader.counters.notified, lambda n: n >= 10_000, timeout=20, interval=0.05)
        storm = reader.counters.passes - before
        await insert(url, [row("storm:1")])
        found = await eventually(
            lambda: receipts(url), lambda f: f["storm:1"]["state"] == "sent", timeout=10, interval=0.05
        )
    print(f"10000 notifications: {storm} passes")
    assert reader.counters.notified >= 10_000
    assert storm <= 100, storm  # woken many times over, one claim per wake-up, not per notification
    assert found["storm:1"]["state"] == "sent"
    assert upstream.event_keys() == ["storm:1"]


async def test_serve_restarted_while_the_database_is_away_loses_the_receipts_in_memory_not_once(
    tmp: Path, upstream: Upstream
) -> None:
    from collections import Counter

    pg = PostgresServer(name="app")
    pg.init()
    pg.start()
    try:
        url = app_database(pg)
        keys = [f"away:{i}" for i in range(60)]
        await insert(url, [row(k) for k in keys])
        cfg = outbox_config(tmp, upstream.port, url, volume=True, batch=60)
        # Short claims, so the rows the first serve claimed come back to the second soon.
        cfg["event_key"].update({"lease": "1s"})
        async with running_guard(cfg) as first:
            await upstream.wait_received(10, timeout=20)
            await asyncio.to_thread(pg.stop)
            await eventually(
                lambda: first.outbox[0].counters.outages, lambda n: n >= 1, timeout=10, interval=0.05
            )
            # Serve stops with receipts it could not write: they were only in its memory.
        sent_by_first = len(upstream.received)
        await asyncio.to_thread(pg.start)
        async with running_guard(cfg):
            found = await eventually(
                lambda: receipts(url),
                lambda f: all(r["state"] not in ("pending", "held") for r in f.values()),
                timeout=30,
                interval=0.1,
            )
    finally:
        pg.remove()
    copies = Counter(upstream.event_keys())
    assert copies == Counter(keys), [k for k, n in copies.items() if n != 1]
    states = Counter(r["state"] for r in found.values())
    assert set(states) <= {"sent", "duplicate"}, states
    # What the first serve sent and could not record reads duplicate, nothing was sent again.
    assert 1 <= states["duplicate"] <= sent_by_first, (states, sent_by_first)


async def test_rows_with_extreme_column_values_never_stop_the_reader_or_the_rows_after_them(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    async with running_guard(outbox_config(tmp, upstream.port, url, batch=10)) as server:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as app:
            insert_one = (
                "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, not_before, attempts) "
                "VALUES (%s, %s, 'billing@acme.example', ARRAY['customer@example.com'], %s, %s)"
            )
            for key, not_before, attempts in [
                ("now:-infinity", "-infinity", 0),  # "as soon as possible", as PostgreSQL spells it
                ("parked:infinity", "infinity", 0),  # never due
                ("attempts:max", None, 2**31 - 1),  # the column's largest value
                ("plain:1", None, 0),
            ]:
                await app.execute(insert_one, (key, row(key).message, not_before, attempts))
        found = await eventually(
            lambda: receipts(url),
            lambda f: all(f[k]["state"] == "sent" for k in ("now:-infinity", "attempts:max", "plain:1")),
            timeout=10,
            interval=0.05,
        )
        reader = server.outbox[0]
        # The counts (the lag gauge) read the parked row too: no pass may fail on it.
        passes = reader.counters.passes
        reader.wake()
        await eventually(lambda: reader.counters.passes, lambda n: n >= passes + 3, timeout=10, interval=0.05)
        assert reader.counters.outages == 0
    assert {k: r["state"] for k, r in found.items()} == {
        "now:-infinity": "sent",
        "parked:infinity": "pending",
        "attempts:max": "sent",
        "plain:1": "sent",
    }
    assert sorted(upstream.event_keys()) == ["attempts:max", "now:-infinity", "plain:1"]


async def test_an_sql_ascii_database_is_refused_by_name_and_its_rows_left_alone(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    import uuid

    from smtpguard.cli import main
    from tests.support import write_config

    # SQL_ASCII stores bytes of no known encoding: psycopg hands its text back as bytes, so
    # a key 'k' would have been read as "b'k'", another event than the one SMTP knows.
    name = f"ascii_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_server.url, autocommit=True) as admin:
        admin.execute(
            f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"  # type: ignore[arg-type]
        )
    url = postgres_server.url.rsplit("/", 1)[0] + "/" + name
    cfg = outbox_config(tmp, upstream.port, url)
    path = write_config(tmp / "smtpguard.yaml", cfg)
    assert await asyncio.to_thread(main, ["outbox", "init", "-c", str(path), "shop"]) == 1
    assert "SQL_ASCII" in capsys.readouterr().err
    from smtpguard.outbox.schema import ddl

    with psycopg.connect(url, autocommit=True) as app:
        app.execute(ddl())  # type: ignore[arg-type]
    await insert(url, [row("ascii:1")])
    async with running_guard(cfg) as server:
        reader = server.outbox[0]
        await eventually(lambda: reader.counters.outages, lambda n: n >= 1, timeout=10, interval=0.05)
        assert reader.counters.outages >= 1 and reader.counters.rows == 0
    (r,) = (await receipts(url)).values()  # read back as bytes, as the reader would have
    assert r["state"] in ("pending", b"pending") and r["reply"] is None and r["attempts"] == 0
    assert upstream.event_keys() == []


async def test_a_claim_leaves_a_message_over_the_size_limit_in_the_database(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from dataclasses import replace

    from smtpguard.outbox import rows
    from smtpguard.outbox.connection import connect

    # 8 rows of 50 MB with a 1 MB limit peaked at 1.4 GB in serve when every message was read
    # (bytea arrives as hex text): batch 100 of them would have ended serve, SMTP included.
    url = app_database(postgres_server)
    big = row("big:1").message + b"y" * 3_000_000
    await insert(url, [replace(row("big:1"), message=big), row("small:1")])
    async with await connect(url, None) as conn:
        now = time.time()
        # Claimed until now: the rows are due again at once, for serve below.
        claimed = {
            r.event_key: r for r in (await rows.claim(conn, "smtpguard_outbox", now, now, 10, 1_000_000)).rows
        }
    assert claimed["big:1"].message == b"" and claimed["big:1"].size == len(big)
    assert claimed["small:1"].message == row("small:1").message
    # And the row is answered as SMTP answers a message over the limit, the other one sent.
    cfg = outbox_config(tmp, upstream.port, url)
    cfg["limits"] = {"max_message_size": 1_000_000}
    async with running_guard(cfg):
        found = await eventually(
            lambda: receipts(url),
            lambda f: all(r["state"] not in ("pending", "held") for r in f.values()),
            timeout=10,
            interval=0.05,
        )
    assert found["big:1"]["state"] == "failed" and str(found["big:1"]["reply"]).startswith("552 5.3.4")
    assert found["small:1"]["state"] == "sent"
    assert upstream.event_keys() == ["small:1"]


async def test_a_reload_mid_batch_hands_the_rows_not_yet_begun_to_the_new_reader_at_once(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    from collections import Counter

    from smtpguard.outbox.reader import CONCURRENCY
    from tests.support import Behaviour, write_config

    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url, volume=True)
    path = tmp / "smtpguard.yaml"
    # The first CONCURRENCY sends are slow: the batch's other rows wait for a turn.
    upstream.handler.script = [Behaviour(hang_after_dot=1.5) for _ in range(CONCURRENCY)]
    keys = [f"midbatch:{i}" for i in range(CONCURRENCY + 4)]
    async with running_guard(cfg, config_path=path) as server:
        (old,) = server.outbox
        await insert(url, [row(k) for k in keys])
        # The provider pool (8 in the test config) holds the first sends: the rows past
        # CONCURRENCY have not begun.
        await upstream.wait_received(8)
        cfg["outbox"]["shop"]["poll"] = "0.3s"  # a changed source: its reader is replaced
        write_config(path, cfg)
        assert await server.reload()
        assert server.outbox[0] is not old
        # The claim (event_key.lease, 30 s) of the 4 rows the old reader never began is
        # given back, not left to lapse.
        found = await eventually(
            lambda: receipts(url),
            lambda f: all(r["state"] == "sent" for r in f.values()),
            timeout=10,
            interval=0.05,
        )
    assert old.counters.rows + server.outbox[0].counters.rows == len(keys)
    assert Counter(r["state"] for r in found.values()) == {"sent": len(keys)}
    assert all(r["attempts"] == 1 for r in found.values()), found
    assert Counter(upstream.event_keys()) == Counter(keys)


async def test_a_message_whose_folded_key_header_names_another_rows_key_does_not_take_that_event(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    # Row 1's column is '=?utf-8?q?order?=', its message's X-Event-Key the same word folded on
    # to a second, which the listener decodes to 'order:2'. Checked by its first line only,
    # it was sent and recorded as order:2; row 2, the application's own order:2 with that
    # message, was then answered `duplicate` and never sent.
    url = app_database(postgres_server)
    second = row("order:2", subject="Order 2 shipped")
    first = row("=?utf-8?q?order?=")
    first.message = b"X-Event-Key: =?utf-8?q?order?=\n =?utf-8?q?=3A2?=\n" + second.message
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        await insert(url, [first])
        await eventually(
            lambda: receipts(url),
            lambda f: f[first.event_key]["state"] != "pending",
            timeout=10,
            interval=0.05,
        )
        await insert(url, [second])
        found = await eventually(
            lambda: receipts(url), lambda f: f["order:2"]["state"] != "pending", timeout=10, interval=0.05
        )
    assert found[first.event_key]["state"] == "failed", found
    assert str(found[first.event_key]["reply"]).startswith("550 5.6.0"), found
    assert found["order:2"]["state"] == "sent", found
    assert upstream.event_keys() == ["order:2"]
