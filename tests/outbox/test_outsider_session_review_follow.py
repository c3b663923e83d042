"""A followed row (its `sg_id` set, as the application can write it) is compared with its
record's message before it takes the record's receipt; a row no submission would take (NULL
in `rcpt_to`) must be answered as an unfollowed one is, not stop the reader's pass."""

from __future__ import annotations

from pathlib import Path

import psycopg

from tests.outbox.test_outsider_outbox_rows import settled
from tests.support import Upstream, running_guard
from tests.support.outbox import app_database, insert, outbox_config, row
from tests.support.postgres import PostgresServer


async def test_a_followed_row_with_null_in_rcpt_to_fails_and_the_next_row_is_sent(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    async with running_guard(outbox_config(tmp, upstream.port, url)) as _:
        await insert(url, [row("inv:7")])
        first = (await settled(url, {"inv:7"}))["inv:7"]
        assert first["state"] == "sent"
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute("DELETE FROM smtpguard_outbox WHERE event_key = 'inv:7'")
            forged = row("inv:7")
            await conn.execute(
                "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, sg_id) "
                "VALUES (%s, %s, %s, %s, %s)",
                (
                    forged.event_key,
                    forged.message,
                    forged.mail_from,
                    ["customer@example.com", None],
                    first["sg_id"],
                ),
            )
        await insert(url, [row("inv:8")])
        found = await settled(url, {"inv:7", "inv:8"})
    print("followed NULL rcpt:", {k: (r["state"], r["reply"]) for k, r in found.items()})
    assert found["inv:7"]["state"] == "failed" and found["inv:7"]["reply"].startswith("501 5.1.3"), found
    assert found["inv:8"]["state"] == "sent", found
    assert upstream.event_keys() == ["inv:7", "inv:8"]
