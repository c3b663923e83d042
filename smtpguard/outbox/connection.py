"""How every part of the outbox reaches a source's database: one autocommit connection,
with the password the caller read (config.outbox_password) and, if asked, a bound on each
statement."""

from __future__ import annotations

from psycopg import AsyncConnection, NotSupportedError
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
    conn: AsyncConnection[TupleRow] = await AsyncConnection.connect(url, **kwargs)  # type: ignore[arg-type]
    if conn.info.parameter_status("server_encoding") == "SQL_ASCII":
        # Text of no known encoding comes back as bytes: an event_key 'k' would read "b'k'",
        # another event than the one SMTP knows. Refused, the rows left as they are.
        await conn.close()
        raise NotSupportedError(
            "the outbox database's encoding is SQL_ASCII (text of no known encoding); "
            "an outbox needs a UTF8 database"
        )
    return conn
