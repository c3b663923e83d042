"""Each outbox source's rows by state and its lag, read from its table: the console's
queue page shows them (it may run without serve, so it asks the table, not a reader)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psycopg

from smtpguard.config import Config, ConfigError
from smtpguard.outbox import rows
from smtpguard.outbox.connection import connect, password_of


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
    out = []
    for name, src in config.outbox.items():
        status = SourceStatus(name, src.zone, src.table)
        out.append(status)
        try:
            conn = await connect(src.url, password_of(name, src), timeout)
            async with conn:
                status.counts, oldest = await rows.counts(conn, src.table)
            status.lag = None if oldest is None else max(time.time() - oldest, 0.0)
        except ConfigError as e:
            status.problem = e.problems[0]
        except psycopg.Error as e:
            # The first line only: libpq's message, never the URL's secret (none is in it).
            status.problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return out
