"""Each outbox source's rows by state and its lag, read from its table: the console's
queue page shows them (it may run without serve, so it asks the table, not a reader)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import psycopg

from smtpguard.config import Config, ConfigError, OutboxSource, outbox_password
from smtpguard.outbox import rows
from smtpguard.outbox.connection import connect


@dataclass
class SourceStatus:
    source: str
    zone: str
    table: str
    counts: dict[str, int] = field(default_factory=dict)
    lag: float | None = None
    """Seconds since the oldest pending row was written; None when none is pending."""
    problem: str | None = None
    """Why the table could not be read (the database unreachable, no table, no secret)."""


async def outbox_status(config: Config, timeout: float = 3.0) -> list[SourceStatus]:
    """Every source at once, each bounded by `timeout` to connect and `timeout` to count:
    a page never waits on a database that is away or a table an application has locked."""
    return list(await asyncio.gather(*(_status(name, src, timeout) for name, src in config.outbox.items())))


async def _status(name: str, src: OutboxSource, timeout: float) -> SourceStatus:
    status = SourceStatus(name, src.zone, src.table)
    try:
        conn = await connect(src.url, outbox_password(name, src), timeout, statement_timeout=timeout)
        async with conn:
            status.counts, oldest = await rows.counts(conn, src.table)
        status.lag = None if oldest is None else max(time.time() - oldest, 0.0)
    except ConfigError as e:
        status.problem = e.problems[0]
    except psycopg.Error as e:
        # The first line only: libpq's message, never the URL's secret (none is in it).
        status.problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return status
