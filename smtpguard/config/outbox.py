"""`outbox:`: PostgreSQL tables an application writes send requests into (DESIGN.md §20)."""

from __future__ import annotations

import re
from urllib.parse import unquote

from pydantic import Field, field_validator

from smtpguard.config.base import Duration, FilePath, _Strict
from smtpguard.config.store import may_land_on_a_standby

_TABLE = re.compile(r"[a-z_][a-z0-9_]{0,55}")
"""56 at most: the index and trigger named after it (`_due`, `_notify`) stay within
PostgreSQL's 63, which would otherwise cut them silently (the index then taking the
table's own name, and IF NOT EXISTS skipping it)."""
SOURCE_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
_SECRET_KEYWORDS = frozenset({"password", "sslpassword"})
"""libpq keywords whose value is a secret: the role's password, the client TLS key's."""


def _query_keywords(url: str) -> set[str]:
    """The keywords of a libpq URL's query as libpq reads them: percent-decoded, so that
    `pass%77ord=` is the `password` it is to libpq."""
    query = url.partition("?")[2]
    return {unquote(item.partition("=")[0]) for item in query.split("&")}


def table_problem(name: str) -> str | None:
    """Why `name` cannot be an outbox table, or None (the config's rule, and `outbox schema
    --table`'s)."""
    if _TABLE.fullmatch(name):
        return None
    return f"table {name!r} must be a lower-case SQL name: letters, digits and _, at most 56"


class OutboxSource(_Strict):
    url: str
    """libpq URL of the application's database; the password comes from password_env or
    password_file, never from the URL in a file that is shared."""
    password_env: str | None = None
    password_file: FilePath | None = None
    table: str = "smtpguard_outbox"
    zone: str
    """Every row is submitted as this zone…"""
    user: str
    """…and this user of it (its own caps apply, DESIGN.md §16)."""
    poll: Duration = Field(2.0, ge=0.05, le=3600.0)
    """LISTEN/NOTIFY wakes the reader at once; polling is the fallback (a lost notification,
    a row whose not_before or retry time came)."""
    batch: int = Field(100, ge=1, le=10_000)
    """Rows claimed in one short transaction."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("an outbox url must start with postgresql:// (the outbox is a PostgreSQL table)")
        userinfo = v.split("://", 1)[1].split("/", 1)[0].rpartition("@")[0]
        if ":" in userinfo or _SECRET_KEYWORDS & _query_keywords(v):
            # The config file is read by operators and kept in repositories: no secret in it.
            raise ValueError("no password in the outbox url: use password_env or password_file")
        if may_land_on_a_standby(v):
            # A standby refuses every claim and receipt: the reader would reconnect to it
            # for ever, the primary a host away.
            raise ValueError(
                "an outbox url naming several PostgreSQL hosts needs target_session_attrs=read-write "
                "(else the reader may land on a standby, which refuses every claim)"
            )
        return v

    @field_validator("table")
    @classmethod
    def _table(cls, v: str) -> str:
        # Written into DDL and every statement as an identifier: only names that need no quoting.
        problem = table_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v
