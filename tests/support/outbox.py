"""The application's side of the outbox in tests: a database of its own on the session's
PostgreSQL, the table `outbox init` makes, and rows inserted in the application's own
transactions (some rolled back), read back as the receipts smtpguard wrote."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import psycopg

from smtpguard.outbox.schema import ddl
from tests.support import base_config, message
from tests.support.postgres import PostgresServer


def new_database(server: PostgresServer, prefix: str = "app") -> str:
    """A fresh database on `server`, its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.url.rsplit("/", 1)[0] + "/" + name


def app_database(server: PostgresServer, table: str = "smtpguard_outbox") -> str:
    url = new_database(server)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(ddl(table))  # type: ignore[arg-type]
    return url


@dataclass
class OutRow:
    event_key: str
    message: bytes
    mail_from: str = "billing@acme.example"
    rcpt_to: Sequence[str] = ("customer@example.com",)


def row(key: str, **kw: Any) -> OutRow:
    """A row as an application writes it: the message from EmailMessage.as_bytes() (bare LF
    line ends, as Python writes them), no X-Event-Key header: the column names the event."""
    sender = kw.pop("mail_from", "billing@acme.example")
    rcpt = kw.pop("rcpt_to", ("customer@example.com",))
    header_from = kw.pop("header_from", sender)
    msg: EmailMessage = message(None, sender=header_from, to=rcpt[0] if rcpt else "x@example.com", **kw)
    return OutRow(key, msg.as_bytes(), sender, rcpt)


_INSERT = "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to) VALUES (%s, %s, %s, %s)"


async def insert(url: str, rows: Sequence[OutRow], commit: bool = True) -> None:
    """One application transaction inserting `rows`, committed or rolled back."""
    async with await psycopg.AsyncConnection.connect(url) as conn:
        async with conn.cursor() as cur:
            await cur.executemany(
                _INSERT, [(r.event_key, r.message, r.mail_from, list(r.rcpt_to)) for r in rows]
            )
        if commit:
            await conn.commit()
        else:
            await conn.rollback()


async def receipts(url: str) -> dict[str, dict[str, Any]]:
    """Every row by event_key: what smtpguard wrote into it."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT event_key, state, reply, sg_id, upstream_id, attempts, next_attempt_at, done_at "
            "FROM smtpguard_outbox ORDER BY id"
        )
        out = {}
        for r in await cur.fetchall():
            out[r[0]] = {
                "state": r[1],
                "reply": r[2],
                "sg_id": r[3],
                "upstream_id": r[4],
                "attempts": r[5],
                "next_attempt_at": r[6],
                "done_at": r[7],
            }
        return out


def open_states(found: dict[str, dict[str, Any]]) -> list[str]:
    return [k for k, r in found.items() if r["state"] in ("pending", "held")]


def outbox_config(
    tmp: Path, upstream_port: int, app_url: str, volume: bool = False, **source: Any
) -> dict[str, Any]:
    """With `volume`, zone acme's caps are out of the way of a backlog of hundreds of rows."""
    cfg = base_config(tmp, upstream_port)
    if volume:
        cfg["zones"]["acme"].update({"hourly_cap": 1_000_000, "monthly_cap": 10_000_000})
    cfg["outbox"] = {"shop": {"url": app_url, "zone": "acme", "user": "acme-app", "poll": "0.2s", **source}}
    return cfg


def pair_configs(
    tmp: Path, upstream_port: int, app_url: str, store_url: str, **source: Any
) -> list[dict[str, Any]]:
    """Instances a and b of one fleet: one outbox table, one PostgreSQL store between them."""
    configs = []
    for name in ("a", "b"):
        cfg = outbox_config(tmp, upstream_port, app_url, **source)
        cfg["store"] = {"url": store_url, "unsafe": True}
        cfg["instance"] = name
        configs.append(cfg)
    return configs
