"""`store:`: which store, its secret, and what a store must promise before `serve` uses it."""

from __future__ import annotations

import urllib.parse

from pydantic import Field, field_validator, model_validator

from smtpguard.config.base import Duration, FieldProblem, FilePath, _Strict

STORE_SCHEMES = ("sqlite:///", "redis://", "rediss://", "redis+sentinel://", "postgresql://", "postgres://")


class StoreWait(_Strict):
    """Redis only (DESIGN.md §15): every ledger write waits for `replicas` replicas (WAIT)
    before any upstream byte; fewer within `timeout` answer 451 4.3.0 and send nothing."""

    replicas: int = Field(ge=1)
    timeout: Duration = Field(0.2, gt=0)


def may_land_on_a_standby(url: str) -> bool:
    """A libpq URL naming several hosts without asking for the read-write one: a connection
    takes the first that answers, a standby after a failover. As libpq reads it: hosts in
    the authority or a `host` parameter, and the last of several target_session_attrs."""
    hosts = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0].rsplit("@", 1)[-1]
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    hosts += ",".join(query.get("host", []))
    attrs = query.get("target_session_attrs", [""])[-1]
    return "," in hosts and attrs not in ("read-write", "primary")


class StoreConfig(_Strict):
    url: str = "sqlite:///var/smtpguard.db"
    password_env: str | None = None
    password_file: FilePath | None = None
    unsafe: bool = False
    """Serve on a store that may forget acknowledged writes (Redis without `appendonly yes`
    and `appendfsync always`, or with an evicting `maxmemory-policy`; PostgreSQL with
    `fsync` or `synchronous_commit` off): a forgotten reservation is a duplicate, so `serve`
    refuses such a store unless this is set (docs/stores.md)."""

    wait: StoreWait | None = None
    pool_size: int | None = Field(None, ge=1, le=1000)
    """PostgreSQL only: the most connections each process (each of `workers`) keeps to the
    server; default 32. The server's max_connections must cover pool_size * workers *
    instances, plus the CLI's and a migration's few (docs/stores.md)."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(STORE_SCHEMES):
            raise ValueError("store url must start with " + ", ".join(STORE_SCHEMES))
        if v.startswith(("postgresql://", "postgres://")) and may_land_on_a_standby(v):
            raise ValueError(
                "a store url naming several PostgreSQL hosts needs target_session_attrs=read-write "
                "(else a connection may land on a standby, which refuses every write)"
            )
        return v

    @model_validator(mode="after")
    def _wait_is_for_redis(self) -> StoreConfig:
        if self.wait is not None and not self.url.startswith(("redis://", "rediss://", "redis+sentinel://")):
            raise ValueError("store.wait is for Redis (WAIT); PostgreSQL waits as synchronous_commit says")
        if self.pool_size is not None and not self.url.startswith(("postgresql://", "postgres://")):
            raise FieldProblem(("pool_size",), "store.pool_size is for PostgreSQL (a connection pool)")
        return self
