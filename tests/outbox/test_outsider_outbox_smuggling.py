"""An application row (or an SQL injection into the application) whose message bytes carry an
end-of-data sequence and a second SMTP transaction: on the SMTP listener such bytes are
refused as smuggling, but an outbox row is normalised to CRLF line ends, so `.` alone on a
line reaches the relay. It must reach the upstream as body text (dot-stuffed on the wire),
never end the transaction: counted at the upstream, one message, from the zone's mapped
sender, with the smuggled lines inside its body, and no transaction from the smuggled
sender of another zone."""

from __future__ import annotations

from pathlib import Path

from tests.support import Upstream, running_guard
from tests.support.eventually import eventually
from tests.support.outbox import OutRow, app_database, insert, outbox_config, receipts
from tests.support.postgres import PostgresServer

SMUGGLED = (
    b"MAIL FROM:<news@globex.example>\n"
    b"RCPT TO:<victim@example.org>\n"
    b"DATA\n"
    b"From: news@globex.example\n"
    b"To: victim@example.org\n"
    b"Subject: smuggled\n"
    b"\n"
    b"not from acme\n"
)


async def test_an_end_of_data_line_in_a_row_is_body_text_at_the_upstream(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = app_database(postgres_server)
    head = (
        b"From: billing@acme.example\nTo: customer@example.com\nSubject: Invoice\n"
        b"MIME-Version: 1.0\nContent-Type: text/plain\n\n"
    )
    rows = [
        OutRow("lf:1", head + b"first line\n.\n" + SMUGGLED + b".\nlast line\n"),
        OutRow("crlf:1", (head + b"first line\n.\n" + SMUGGLED + b".\nlast line\n").replace(b"\n", b"\r\n")),
        OutRow("cr:1", (head + b"first line\n.\n" + SMUGGLED + b".\nlast line\n").replace(b"\n", b"\r")),
    ]
    async with running_guard(outbox_config(tmp, upstream.port, url)) as _:
        await insert(url, rows)
        found = await eventually(
            lambda: receipts(url),
            lambda f: all(r["state"] not in ("pending", "held") for r in f.values()),
            timeout=20,
            interval=0.1,
        )
    assert {k: r["state"] for k, r in found.items()} == {"lf:1": "sent", "crlf:1": "sent", "cr:1": "sent"}, (
        found
    )
    assert len(upstream.received) == 3
    assert upstream.handler.transactions == 3
    for got in upstream.received:
        assert got.mail_from == "billing@acme.example"
        assert got.rcpt_tos == ["customer@example.com"]
        body = got.content.split(b"\r\n\r\n", 1)[1]
        assert body.startswith(b"first line\r\n.\r\nMAIL FROM:<news@globex.example>\r\n"), body[:80]
        assert body.endswith(b"not from acme\r\n.\r\nlast line\r\n"), body[-80:]
