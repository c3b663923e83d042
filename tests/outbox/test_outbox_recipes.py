"""docs/recipes.md's outbox recipes, run as written against a real PostgreSQL; and the
`outbox init` / `outbox schema` commands that make the table they insert into.

psql and the Django and SQLAlchemy code run as child processes (each library configured as
an application would, on its own connection); the Rails and Laravel statements run
verbatim through psycopg's raw cursor, which takes `$n` placeholders as libpq does (PDO
turns each `?` into `$n` before PostgreSQL sees it; the test does the same).
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections import Counter
from email.message import EmailMessage
from pathlib import Path

import psycopg
import pytest

from smtpguard.cli import main
from smtpguard.outbox.schema import ddl
from tests.support import Upstream, eventually, running_guard, write_config
from tests.support.outbox import new_database, outbox_config, receipts
from tests.support.postgres import PostgresServer

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def recipe(name: str) -> str:
    text = RECIPES.read_text()
    found = re.search(rf"<!-- outbox-recipe: {name} -->\n```\w+\n(.*?)```", text, re.S)
    assert found, f"no outbox recipe {name!r} in docs/recipes.md"
    return found.group(1)


async def business_database(server: PostgresServer, tmp: Path) -> str:
    """An application database with an orders table, and the outbox made by `outbox init`."""
    url = new_database(server)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL DEFAULT 'new')")
        conn.execute("INSERT INTO orders (id) SELECT generate_series(1040, 1050)")
    cfg = outbox_config(tmp, 25, url)
    path = write_config(tmp / "init.yaml", cfg)
    # The CLI runs its own event loop: off this one.
    init = ["outbox", "init", "-c", str(path), "shop"]
    assert await asyncio.to_thread(main, init) == 0
    assert await asyncio.to_thread(main, init) == 0  # idempotent
    return url


async def child(*argv: str, stdin: bytes = b"") -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def delivered(url: str, upstream: Upstream, keys: list[str]) -> dict[str, dict[str, object]]:
    found = await eventually(
        lambda: receipts(url),
        lambda f: all(f.get(k, {}).get("state") == "sent" for k in keys),
        timeout=20,
        interval=0.05,
    )
    assert {k: found[k]["state"] for k in keys} == dict.fromkeys(keys, "sent")
    assert Counter(upstream.event_keys()) == Counter(keys)
    return found


def statuses(url: str) -> dict[int, str]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute("SELECT id, status FROM orders WHERE status <> 'new'").fetchall())  # type: ignore[arg-type]


async def test_plain_psql(tmp: Path, upstream: Upstream, postgres_server: PostgresServer) -> None:
    url = await business_database(postgres_server, tmp)
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        await child(
            "psql", url, "-v", "ON_ERROR_STOP=1", "-q", "-c", "\\i /dev/stdin", stdin=recipe("psql").encode()
        )
        await delivered(url, upstream, ["order-confirmed:1044"])
    assert statuses(url) == {1044: "confirmed"}
    assert b"Subject: Order 1044 confirmed\r\n" in upstream.received[0].content


DJANGO = """
import django
from django.conf import settings

settings.configure(DATABASES={{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {name!r}, "USER": "postgres",
    "HOST": "127.0.0.1", "PORT": {port},
}}}})
django.setup()
{recipe}
from django.db import transaction

confirm_order(1041, "customer@example.com")
try:
    with transaction.atomic():
        confirm_order(1042, "other@example.com")
        raise RuntimeError("the business change failed after the insert")
except RuntimeError:
    pass
"""


async def test_django_transaction_atomic(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = await business_database(postgres_server, tmp)
    script = DJANGO.format(name=url.rsplit("/", 1)[1], port=postgres_server.port, recipe=recipe("django"))
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        await child(sys.executable, "-c", script)
        # The committed order is the positive event; the rolled-back one is then looked for once.
        found = await delivered(url, upstream, ["order-confirmed:1041"])
    assert "order-confirmed:1042" not in found
    assert statuses(url) == {1041: "confirmed"}


SQLALCHEMY = """
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
{recipe}
engine = create_engine({url!r})
with Session(engine) as session:
    confirm_order(session, 1043, "customer@example.com")
"""


async def test_sqlalchemy_session_begin(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer
) -> None:
    url = await business_database(postgres_server, tmp)
    script = SQLALCHEMY.format(
        url=url.replace("postgresql://", "postgresql+psycopg://"), recipe=recipe("sqlalchemy")
    )
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        await child(sys.executable, "-c", script)
        await delivered(url, upstream, ["order-confirmed:1043"])
    assert statuses(url) == {1043: "confirmed"}


def _message(order: int) -> str:
    msg = EmailMessage()
    msg["From"] = "billing@acme.example"
    msg["To"] = "customer@example.com"
    msg["Subject"] = f"Order {order} confirmed"
    msg.set_content("Thank you for your order.")
    return msg.as_string()


@pytest.mark.parametrize(("framework", "order"), [("rails", 1045), ("laravel", 1046)])
async def test_rails_and_laravel_statements_verbatim(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer, framework: str, order: int
) -> None:
    url = await business_database(postgres_server, tmp)
    statement = recipe(framework)
    if framework == "laravel":
        # What PDO's pgsql driver does with positional placeholders before sending.
        counter = iter(range(1, 100))
        statement = re.sub(r"\?", lambda _: f"${next(counter)}", statement)
    params = [f"order-confirmed:{order}", _message(order), "billing@acme.example", "customer@example.com"]
    async with running_guard(outbox_config(tmp, upstream.port, url)):
        conn = await psycopg.AsyncConnection.connect(url, cursor_factory=psycopg.AsyncRawCursor)
        async with conn, conn.transaction():
            await conn.execute("UPDATE orders SET status = 'confirmed' WHERE id = $1", [order])
            await conn.execute(statement, params)  # type: ignore[arg-type]
        await delivered(url, upstream, [f"order-confirmed:{order}"])
    assert statuses(url) == {order: "confirmed"}


def test_outbox_schema_prints_the_ddl_init_runs(capsys: pytest.CaptureFixture[str], tmp: Path) -> None:
    assert main(["outbox", "schema", "--table", "shop_mail"]) == 0
    printed = capsys.readouterr().out
    assert printed == ddl("shop_mail")
    for column in ("event_key text NOT NULL UNIQUE", "message bytea NOT NULL", "rcpt_to text[] NOT NULL"):
        assert column in printed
    path = write_config(
        tmp / "c.yaml", outbox_config(tmp, 25, "postgresql://app@127.0.0.1:1/app", table="mail")
    )
    assert main(["outbox", "schema", "-c", str(path), "shop"]) == 0
    assert capsys.readouterr().out == ddl("mail")


def test_outbox_schema_refuses_a_table_name_that_is_not_a_plain_sql_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["outbox", "schema", "--table", "x; drop table y"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "lower-case SQL name" in captured.err


def test_outbox_init_names_an_unknown_source_and_an_unreachable_database(
    capsys: pytest.CaptureFixture[str], tmp: Path
) -> None:
    from tests.support import free_port

    path = write_config(
        tmp / "c.yaml", outbox_config(tmp, 25, f"postgresql://app@127.0.0.1:{free_port()}/app")
    )
    assert main(["outbox", "init", "-c", str(path), "nope"]) == 2
    assert "no outbox source 'nope'" in capsys.readouterr().err
    assert main(["outbox", "init", "-c", str(path), "shop"]) == 4
    assert "outbox database unavailable" in capsys.readouterr().err


def test_check_config_names_an_outbox_password_that_is_missing(
    capsys: pytest.CaptureFixture[str], tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHOP_OUTBOX_PASSWORD", raising=False)
    cfg = outbox_config(tmp, 25, "postgresql://app@127.0.0.1:1/app", password_env="SHOP_OUTBOX_PASSWORD")
    path = write_config(tmp / "c.yaml", cfg)
    assert main(["check-config", "-c", str(path)]) == 1
    assert "outbox.shop: environment variable SHOP_OUTBOX_PASSWORD is not set" in capsys.readouterr().err
