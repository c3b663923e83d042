"""How every part of the outbox reaches a source's database: one autocommit connection,
with the password the caller read (config.outbox_password) and, if asked, a bound on each
statement."""

from __future__ import annotations

from psycopg import AsyncConnection
from psycopg.rows import TupleRow


async def connect(
    url: str, password: str | None, timeout: float = 5.0, statement_timeout: float | None = None
) -> AsyncConnection[TupleRow]:
    """Autocommit: every statement is its own short transaction unless a block opens one.

    `statement_timeout` bounds each statement, waiting for a lock included: a reader of
    the table that must answer (the console) is not held by an application's migration."""
    kwargs: dict[str, object] = {"autocommit": True, "connect_timeout": max(int(timeout), 1)}
    if statement_timeout is not None:
        kwargs["options"] = f"-c statement_timeout={max(int(statement_timeout * 1000), 1)}"
    if password is not None:
        kwargs["password"] = password
    return await AsyncConnection.connect(url, **kwargs)  # type: ignore[arg-type]
