"""`smtpguard migrate`: the schema upgrade run ahead of a rolling upgrade (DESIGN.md §18),
so the new release's instances start on a current schema and the old ones keep serving
while it runs. The same migrations `serve` runs at start (migrate.py), on one connection."""

from __future__ import annotations

from typing import Any

import psycopg

from smtpguard.store.base import StoreUnavailable, StoreUnfit
from smtpguard.store.postgres.fencing import Fence
from smtpguard.store.postgres.migrate import Migrated, SchemaBehind, migrate


async def run_migrations(url: str, password: str | None) -> Migrated:
    kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": 10}
    if password is not None:
        kwargs["password"] = password
    fence = Fence(url, kwargs)
    try:
        conn = await psycopg.AsyncConnection.connect(await fence.conninfo(), **kwargs)
        async with conn:
            return await migrate(conn)
    except SchemaBehind as e:
        raise StoreUnfit(str(e)) from None
    except psycopg.Error as e:
        raise StoreUnavailable(f"postgresql: {type(e).__name__}: {str(e).strip()[:300]}") from e
