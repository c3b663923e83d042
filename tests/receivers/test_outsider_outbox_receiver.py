"""An outbox row (DESIGN.md §20) to a recipient of a paused receiver (§21), in relay mode: the
outbox is its own SMTP client and its envelope checks are the listener's, so the row is held
as RCPT would hold that recipient — `451 4.7.1`, pending, nothing sent — and goes once the
receiver is resumed, counted per receiver as a listener's relay is. A real PostgreSQL for the
application's table, a real DNS server (NSD), a recording upstream."""

from __future__ import annotations

from pathlib import Path

from smtpguard import desk
from tests.support import Upstream, eventually, running_guard
from tests.support.dns import NsdServer
from tests.support.outbox import app_database, insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer

RECORDS = [
    "gm IN MX 5 aspmx.l.google.com.",
    "yh IN MX 1 mta5.am0.yahoodns.net.",
]


async def test_an_outbox_row_to_a_paused_receiver_waits(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer, dns_server: NsdServer
) -> None:
    url = app_database(postgres_server)
    cfg = outbox_config(tmp, upstream.port, url)
    cfg["queue"] = {"backoff": {"base": "1s", "max": "1s"}}  # a held row is tried again soon
    cfg["event_key"] = {"min_retry_interval": "1s"}
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    cfg["receivers"] = {}
    async with running_guard(cfg) as guard:
        assert guard.store is not None and guard.assembly.receivers is not None
        await desk.set_receiver_paused(guard.store, "acme", "yahoo", True, "cli:test")
        await guard.assembly.receivers.gate.pauses.paused()
        await insert(url, [row("to:yahoo", rcpt_to=("y@yh.test",)), row("to:gmail", rcpt_to=("g@gm.test",))])
        found = await eventually(
            lambda: receipts(url),
            lambda f: f.get("to:gmail", {}).get("state") == "sent" and f["to:yahoo"]["attempts"] >= 1,
            timeout=20,
            interval=0.1,
        )
        print("receipts:", {k: (v["state"], v["reply"]) for k, v in found.items()})
        print("upstream:", [r.rcpt_tos for r in upstream.received])
        assert found["to:yahoo"]["state"] == "pending", found["to:yahoo"]
        assert str(found["to:yahoo"]["reply"]).startswith("451 4.7.1"), found["to:yahoo"]
        assert [r.rcpt_tos for r in upstream.received] == [["g@gm.test"]]
        await desk.set_receiver_paused(guard.store, "acme", "yahoo", False, "cli:test")
        await guard.assembly.receivers.gate.pauses.paused()
        found = await eventually(
            lambda: receipts(url), lambda f: f["to:yahoo"]["state"] == "sent", timeout=20, interval=0.1
        )
        assert sorted(r.rcpt_tos[0] for r in upstream.received) == ["g@gm.test", "y@yh.test"]
        sends = guard.metrics.receiver_sends
        assert sends.labels("acme", "gmail")._value.get() == 1
        assert sends.labels("acme", "yahoo")._value.get() == 1
