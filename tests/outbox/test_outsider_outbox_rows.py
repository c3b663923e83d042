"""Outbox rows an application (or an SQL injection into it) can write, from outside
(DESIGN.md §20): the columns smtpguard owns (`state`, `sg_id`) are writable too. A row must
be answered as SMTP would answer its message; a forged receipt column must never make a
message that was not sent read `sent`. Counted at the upstream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from tests.support import Upstream, running_guard
from tests.support.eventually import eventually
from tests.support.outbox import OutRow, app_database, insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


async def settled(url: str, keys: set[str]) -> dict[str, dict[str, Any]]:
    return await eventually(
        lambda: receipts(url),
        lambda f: keys <= f.keys() and all(f[k]["state"] not in ("pending", "held") for k in keys),
        timeout=20,
        interval=0.1,
    )


async def test_a_forged_sg_id_does_not_make_another_message_read_sent(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    """Row `inv:1` is sent. The application then replaces it by a row of the same key with
    another message, `sg_id` copied from the first receipt (a copy of the row, a restore,
    an injection). SMTP would answer the new message `550 5.7.0 … reused …`; the row must
    say so, not read `sent` with the first message's receipt while its own was never sent."""
    url = app_database(postgres_server)
    async with running_guard(outbox_config(tmp, upstream.port, url)) as _:
        await insert(url, [row("inv:1", subject="Invoice 1")])
        first = (await settled(url, {"inv:1"}))["inv:1"]
        assert first["state"] == "sent"
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute("DELETE FROM smtpguard_outbox WHERE event_key = 'inv:1'")
            other = row("inv:1", subject="Invoice 1, corrected total")
            for forged_state in ("pending", "held"):
                key = "inv:1" if forged_state == "pending" else "inv:1:held"
                await conn.execute(
                    "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, state, sg_id) "
                    "VALUES (%s, %s, %s, %s, %s, %s)",
                    (key, other.message, other.mail_from, list(other.rcpt_to), forged_state, first["sg_id"]),
                )
        found = await settled(url, {"inv:1", "inv:1:held"})
    print(
        f"forged sg_id: upstream={len(upstream.received)} "
        f"receipts={ {k: (r['state'], r['reply']) for k, r in found.items()} }"
    )
    assert sorted(upstream.event_keys()) == ["inv:1", "inv:1:held"]
    assert found["inv:1"]["state"] == "failed", found["inv:1"]
    assert found["inv:1"]["reply"].startswith("550 5.7.0"), found["inv:1"]
    assert "reused" in found["inv:1"]["reply"]
    # A key with no record: nothing to follow, the row is submitted like any other.
    assert found["inv:1:held"]["state"] == "sent", found["inv:1:held"]


async def test_header_and_command_injection_in_the_address_columns_is_refused(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    """CR, LF or NUL in `mail_from` or an element of `rcpt_to` would add an SMTP command (a
    second recipient, another sender) on the relay's wire. Each row fails on its own with a
    5xx naming the address, nothing is relayed for it, and the clean row after them is sent."""
    url = app_database(postgres_server)
    injected = {
        "inj:from-crlf": ("billing@acme.example>\r\nRCPT TO:<victim@example.org", ("customer@example.com",)),
        "inj:from-lf": ("billing@acme.example\nX-Injected: 1", ("customer@example.com",)),
        "inj:rcpt-crlf": ("billing@acme.example", ("customer@example.com>\r\nRCPT TO:<victim@example.org",)),
        "inj:rcpt-cr": ("billing@acme.example", ("customer@example.com\rDATA",)),
        "inj:rcpt-nul": ("billing@acme.example", ("customer@example.com\x00victim@example.org",)),
        "inj:alias": ("ceo@globex.example", ("customer@example.com",)),
    }
    rows_in = [OutRow(k, row(k).message, f, r) for k, (f, r) in injected.items()]
    rows_in.append(row("inj:clean"))
    async with running_guard(outbox_config(tmp, upstream.port, url)) as _:
        for r in rows_in:
            try:
                await insert(url, [r])
            except psycopg.Error:
                # PostgreSQL itself refuses NUL in text: that row never exists.
                injected.pop(r.event_key)
        found = await settled(url, {*injected, "inj:clean"})
    print("injection:", {k: (r["state"], r["reply"]) for k, r in found.items()})
    for key in injected:
        assert found[key]["state"] == "failed", (key, found[key])
        assert found[key]["reply"][:1] == "5", (key, found[key])
    assert found["inj:alias"]["reply"].startswith("550 5.7.1"), found["inj:alias"]
    assert found["inj:clean"]["state"] == "sent"
    assert upstream.event_keys() == ["inj:clean"]
    assert [r.rcpt_tos for r in upstream.received] == [["customer@example.com"]]
