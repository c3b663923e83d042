"""`smtpguard migrate`: the schema upgrade run ahead of a rolling upgrade (DESIGN.md §18),
so the new release's instances start on a current schema and the old ones keep serving
while it runs. The same migrations `serve` runs at start (migrate.py), on one connection."""

from __future__ import annotations

from typing import Any

import psycopg

from smtpguard.store.base import StoreUnavailable, StoreUnfit
from smtpguard.store.postgres.fencing import Fence
from smtpguard.store.postgres.migrate import Migrated, SchemaBehind, migrate_on_own_connection


async def run_migrations(url: str, password: str | None) -> Migrated:
    kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": 10}
    if password is not None:
        kwargs["password"] = password
    fence = Fence(url, kwargs)
    try:
        done = await migrate_on_own_connection(await fence.conninfo(), kwargs)
    except SchemaBehind as e:
        raise StoreUnfit(str(e)) from None
    except psycopg.OperationalError as e:  # fenced: no server to write to
        raise StoreUnavailable(str(e)) from e
    if done is None:
        raise StoreUnavailable("postgresql: no server of store.url answered")
    return done
