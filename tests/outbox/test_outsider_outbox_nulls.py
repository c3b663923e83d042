"""An outbox table whose columns allow NULL: made by the application's own model (an ORM
field left `null=True`) rather than by `outbox schema`, whose DDL says NOT NULL. A row with
a NULL in it is a bad row like any other: `failed` with a reply naming the problem, never
blocking the rows after it. One NULL `message` failed the whole claim (int(None) reading
its size): every row of its batch, the oldest of the table, stayed pending for good, and
nothing was sent again. Counted at the recording upstream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from tests.support import Upstream, eventually, running_guard
from tests.support.outbox import app_database, outbox_config, row
from tests.support.postgres import PostgresServer

_NULLABLE = (
    "ALTER TABLE smtpguard_outbox ALTER COLUMN event_key DROP NOT NULL, "
    "ALTER COLUMN message DROP NOT NULL, ALTER COLUMN mail_from DROP NOT NULL, "
    "ALTER COLUMN rcpt_to DROP NOT NULL, ALTER COLUMN created_at DROP NOT NULL, "
    "ALTER COLUMN attempts DROP NOT NULL"
)
_INSERT = (
    "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to, created_at, attempts) "
    "VALUES (%s, %s, %s, %s, coalesce(%s, now()), %s)"
)


async def _rows(url: str) -> dict[str, dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute("SELECT id, event_key, state, reply FROM smtpguard_outbox ORDER BY id")
        return {f"{i}:{k}": {"state": s, "reply": r} for i, k, s, r in await cur.fetchall()}


async def _settled(tmp: Path, upstream: Upstream, url: str) -> dict[str, dict[str, Any]]:
    """The table's rows once smtpguard has served it until none is pending or held."""
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        return await eventually(
            lambda: _rows(url),
            lambda f: all(r["state"] not in ("pending", "held") for r in f.values()),
            timeout=10,
            interval=0.05,
        )


async def test_rows_with_a_null_fail_naming_it_and_the_rows_after_them_are_sent(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    good = row("good:1").message
    mail, rcpt = "billing@acme.example", ["customer@example.com"]
    with psycopg.connect(url, autocommit=True) as app:
        app.execute(_NULLABLE)
        for values in [
            (None, row("null:key").message, mail, rcpt, None, 0),
            ("null:message", None, mail, rcpt, None, 0),
            ("null:mail_from", row("null:mail_from").message, None, rcpt, None, 0),
            ("null:rcpt_to", row("null:rcpt_to").message, mail, None, None, 0),
            ("good:1", good, mail, rcpt, None, None),  # NULL attempts: a good row all the same
        ]:
            app.execute(_INSERT, values)
        app.execute("UPDATE smtpguard_outbox SET created_at = NULL WHERE event_key = 'good:1'")
    found = await _settled(tmp, upstream, url)
    states = {k.split(":", 1)[1]: (r["state"], str(r["reply"])) for k, r in found.items()}
    assert states["good:1"][0] == "sent"
    assert states["None"][0] == "failed" and states["None"][1].startswith("550 5.6.0"), states
    assert states["null:message"][0] == "failed" and states["null:message"][1].startswith("5"), states
    assert states["null:mail_from"][0] == "failed" and "mail_from" in states["null:mail_from"][1], states
    assert states["null:rcpt_to"][0] == "failed" and states["null:rcpt_to"][1].startswith("5"), states
    assert upstream.event_keys() == ["good:1"]


async def test_columns_of_the_applications_own_types_are_read_or_fail_their_row_alone(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    # A model of the application's: the message as text (Rails `t.text`), the recipients
    # as json. Text is the message's UTF-8; a json recipient list that is no list fails its
    # row. Either once failed every claim, and the outbox sent nothing more.
    url = app_database(postgres_server)
    with psycopg.connect(url, autocommit=True) as app:
        app.execute(
            "ALTER TABLE smtpguard_outbox "
            "ALTER COLUMN message TYPE text USING convert_from(message, 'UTF8'), "
            "ALTER COLUMN rcpt_to TYPE jsonb USING to_jsonb(rcpt_to)"
        )
        for key, rcpt in [("json:scalar", "5"), ("text:1", '["customer@example.com"]')]:
            app.execute(
                "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to) "
                "VALUES (%s, %s, %s, %s)",
                (key, row(key, subject="Grüße").message.decode(), "billing@acme.example", rcpt),
            )
    found = await _settled(tmp, upstream, url)
    states = {k.split(":", 1)[1]: (r["state"], str(r["reply"])) for k, r in found.items()}
    print(states)
    assert states["text:1"][0] == "sent", states
    assert states["json:scalar"][0] == "failed" and "could not be read" in states["json:scalar"][1], states
    assert upstream.event_keys() == ["text:1"]
    assert "Grüße".encode() in upstream.received[0].content or b"=?utf-8?" in upstream.received[0].content
