"""How every part of the outbox reaches a source's database: its password (from the
environment or a file, read once by the caller) and one autocommit connection."""

from __future__ import annotations

from psycopg import AsyncConnection
from psycopg.rows import TupleRow

from smtpguard.config import OutboxSource, read_secret


def password_of(name: str, src: OutboxSource) -> str | None:
    """The source's password; a missing variable or file is a ConfigError naming it."""
    return read_secret(src.password_env, src.password_file, f"outbox.{name}")


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
