"""PostgreSQL with the least-privilege role docs/stores.md advises (SELECT, INSERT, UPDATE,
DELETE on the tables, USAGE on the sequences; no CREATE, not the owner) for everything an
instance does beyond the relay the upgrade tests cover: a signed provider webhook applied
(its event remembered, the recipient suppressed), a wrong console login counted and a
right one followed by a pause, the CLI's suppress, resume and history. Counted at the
upstream: only the messages smtpguard answered with a fresh 250 arrived."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path

from smtpguard.cli import main
from tests.store.test_postgres_upgrade import config_for, database, drop_database, grant_dml
from tests.support import Upstream, message, running_guard, send, suppressions_refreshed, write_config
from tests.support import events as ev
from tests.support.console import PASSWORDS, Operator, console_config
from tests.support.postgres import PostgresServer

RCPT = "gone@example.net"


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


async def test_a_dml_only_role_applies_webhooks_and_serves_the_console_and_the_cli(
    postgres_server: PostgresServer, tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    name = "sg_outsider_dml"
    url = database(postgres_server, name)
    try:
        owner = write_config(tmp / "owner.yaml", config_for(tmp, upstream.port, url, "owner", 0))
        assert await asyncio.to_thread(main, ["migrate", "-c", str(owner)]) == 0
        cfg = config_for(tmp, upstream.port, grant_dml(url), "dml", 0)
        cfg["console"] = console_config(tmp, upstream)["console"]
        cfg["events"] = {"address": "127.0.0.1:0", "sources": {"mailgun": keys.sources()["mailgun"]}}
        path = write_config(tmp / "dml.yaml", cfg)
        async with running_guard(cfg, config_path=path) as guard:
            port = guard.ports[0]
            assert (await send(port, message("dml:1", to=RCPT), recipients=[RCPT])).code == 250
            message_id = upstream.received[-1].header("Message-ID")
            assert message_id
            assert guard.events is not None
            bounce = ev.mailgun_event("failed", RCPT, message_id, severity="permanent")
            status, _ = await ev.post(guard.events.port, "mailgun", ev.mailgun(keys, bounce))
            assert status == 200
            again, _ = await ev.post(guard.events.port, "mailgun", ev.mailgun(keys, bounce))
            assert again == 200
            suppressions_refreshed(guard)
            refused = await send(port, message("dml:2", to=RCPT), recipients=[RCPT])
            assert refused.code == 550 and "5.1.1" in refused.text, refused

            assert guard.console is not None
            browser = Operator(guard.console.port)
            try:
                assert (await browser.login("alice", "not-her-password")).status == 401
                page = await browser.login("alice", PASSWORDS["alice"])
                assert page.status == 200, page.text[:300]
                paused = await browser.post("/zones/acme/pause", {})
                assert paused.status == 200, paused.text[:300]
            finally:
                await browser.close()
            held = await send(port, message("dml:3"))
            assert held.code == 451, held

            code, out = await asyncio.to_thread(_cli, "resume", "-c", str(path), "acme")
            assert code == 0, out
            code, out = await asyncio.to_thread(_cli, "suppress", "remove", "-c", str(path), "acme", RCPT)
            assert code == 0, out
            suppressions_refreshed(guard)
            # No wait for the resume: the zone's pause is read in the reservation itself.
            assert (await send(port, message("dml:3"))).code == 250
            assert (await send(port, message("dml:2", to=RCPT), recipients=[RCPT])).code == 250
            code, out = await asyncio.to_thread(_cli, "history", "-c", str(path), "acme", "dml:1", "--json")
            assert code == 0, out
            record = json.loads(out)
            assert [e["type"] for e in record["events"]] == ["bounce"], record
    finally:
        drop_database(postgres_server, name)
    assert upstream.event_keys() == ["dml:1", "dml:3", "dml:2"]
