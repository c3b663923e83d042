"""`outbox init SOURCE` and `outbox schema`: the outbox table of DESIGN.md §20."""

from __future__ import annotations

import argparse
import asyncio

from smtpguard.cli.context import EXIT_OK, EXIT_STORE, CLIError, UsageError, _config, emit
from smtpguard.config import outbox_password
from smtpguard.config.outbox import table_problem
from smtpguard.outbox.schema import DEFAULT_TABLE, ddl

INIT_LOCK_WAIT = 2.0
"""How long `outbox init` waits for the table's lock: the application's inserts queue behind
it meanwhile."""


class OutboxUnavailable(CLIError):
    code = EXIT_STORE


def cmd_outbox(args: argparse.Namespace) -> int:
    if args.action == "schema":
        table = args.table or DEFAULT_TABLE
        problem = table_problem(table)
        if problem is not None:
            raise UsageError(problem)
        if args.source is not None:
            src = _config(args).outbox.get(args.source)
            if src is None:
                raise UsageError(f"no outbox source {args.source!r} in the config")
            table = src.table
        print(ddl(table), end="")
        return EXIT_OK
    if args.source is None:
        raise UsageError("outbox init needs a SOURCE: a name under `outbox:` in the config")
    config = _config(args)
    src = config.outbox.get(args.source)
    if src is None:
        known = ", ".join(sorted(config.outbox)) or "none"
        raise UsageError(f"no outbox source {args.source!r} in the config (sources: {known})")
    asyncio.run(_init(src.url, outbox_password(args.source, src), src.table))
    if args.json:
        emit({"source": args.source, "table": src.table, "created": True})
    else:
        print(f"outbox {args.source}: table {src.table} and its trigger are in place")
    return EXIT_OK


async def _init(url: str, password: str | None, table: str) -> None:
    import psycopg

    from smtpguard.outbox.connection import connect

    try:
        async with await connect(url, password, 10.0) as conn:
            # Re-made on a live table, the trigger needs the table to itself: waiting for that
            # behind an open transaction of the application's would queue every other insert
            # behind this one, stalling the application. Given up instead, nothing changed.
            await conn.execute(f"SET lock_timeout = '{INIT_LOCK_WAIT * 1000:.0f}ms'")
            # One simple query: its statements commit together or not at all.
            await conn.execute(ddl(table))
    except psycopg.errors.LockNotAvailable:
        raise OutboxUnavailable(
            f"outbox init: table {table} is in use (its lock was not granted within "
            f"{INIT_LOCK_WAIT:g} s: a transaction of the application's is open on it); "
            "nothing was changed, run it again"
        ) from None
    except psycopg.OperationalError as e:
        raise OutboxUnavailable(f"outbox database unavailable: {str(e).strip().splitlines()[0]}") from None
    except psycopg.Error as e:
        raise CLIError(f"outbox init refused by the database: {str(e).strip().splitlines()[0]}") from None
