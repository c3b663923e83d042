"""`smtpguard doctor`'s store check (DESIGN.md §18): for a PostgreSQL store, whether the
server written to has a synchronous standby streaming, and whether fencing holds a second
writable server back. Read-only: nothing is migrated or written."""

from __future__ import annotations

from typing import Any

from smtpguard.config import Config, read_secret
from smtpguard.policy.readiness import Finding, Status


async def store_findings(config: Config) -> list[Finding]:
    url = config.store.url
    if not url.startswith(("postgresql://", "postgres://")):
        return []
    import psycopg

    from smtpguard.store.postgres.fencing import Fence
    from smtpguard.store.postgres.replication import FACTS_SQL, ServerFacts, failover_problem

    kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": 5}
    password = read_secret(config.store.password_env, config.store.password_file, "store")
    if password is not None:
        kwargs["password"] = password
    fence = Fence(url, kwargs)
    out: list[Finding] = []
    try:
        info = await fence.conninfo()
        if fence.choice.fenced:
            out.append(Finding("store", None, None, None, "error", fence.choice.reason))
        async with await psycopg.AsyncConnection.connect(info, **kwargs) as conn:
            row = await (await conn.execute(FACTS_SQL)).fetchone()
    except psycopg.Error as e:
        detail = f"postgresql: {type(e).__name__}: {str(e).strip()[:300]}"
        return [*out, Finding("store", None, None, None, "error", detail)]
    assert row is not None
    facts = ServerFacts.of(row)
    status: Status
    problem = failover_problem(facts)
    if not fence.multi_host:
        status, detail = "ok", "postgresql: a single server (no failover configured)"
    elif problem is not None:
        status, detail = "error", problem
    elif facts.synchronous is None:
        status = "warning"
        detail = (
            "postgresql: waits for a synchronous standby; whether one streams is unknown "
            "(grant pg_monitor to the store's role to see pg_stat_replication)"
        )
    elif facts.synchronous:
        status, detail = "ok", "postgresql: a synchronous standby is streaming"
    else:
        status = "warning"
        detail = "postgresql: no synchronous standby is streaming (commits wait for one)"
    return [*out, Finding("store", None, None, None, status, detail)]
