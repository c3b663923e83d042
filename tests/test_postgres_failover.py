"""Failover of the PostgreSQL store under load (DESIGN.md §15), counted at the upstream.

A primary and a synchronous streaming standby (`pg_basebackup -R`,
`synchronous_standby_names = '*'`) on loopback ports, run unprivileged. One `smtpguard
serve` holds the libpq multi-host URL of both with `target_session_attrs=read-write`.
Clients submit distinct keys as fast as they are answered and retry the same key on a
4xx, as a mail client does. Mid-storm the primary is killed with `kill -9`; a second later
the standby is promoted. Counted: duplicates at the upstream (must be 0), client 250s that
never reached the upstream (lost: must be 0), and the keys still held at the end, each
`unknown` in the ledger (its outcome write was lost with the primary).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest

from smtpguard.policy.ledger import State
from smtpguard.store.postgres import PostgresStore
from tests.failover_support import storm
from tests.postgres_support import PostgresServer
from tests.support import (
    Behaviour,
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    write_config,
)

pytestmark = pytest.mark.slow

WORKERS = 16
LEASE = 4.0


def wait_sync_standby(primary: PostgresServer, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with psycopg.connect(primary.url, autocommit=True) as conn:
            row = conn.execute("SELECT sync_state FROM pg_stat_replication").fetchone()
        if row is not None and row[0] == "sync":
            return
        time.sleep(0.1)
    raise RuntimeError("the standby did not become synchronous")


async def test_primary_killed_mid_storm_standby_promoted_nothing_twice_nothing_lost(
    tmp: Path, upstream: Upstream
) -> None:
    started = time.monotonic()
    # The provider takes a moment after the dot, so sessions are between the data_sent note
    # and the outcome write when the primary dies.
    upstream.handler.default = Behaviour(hang_after_dot=0.05)
    primary, standby = PostgresServer(name="primary"), PostgresServer(name="standby")
    guard: GuardProcess | None = None
    try:
        primary.init(synchronous_standby_names="'*'", synchronous_commit="on", wal_keep_size="64MB")
        primary.start()
        standby.base_backup_of(primary)
        # Its copy of postgresql.conf names a synchronous standby too: promoted, it would wait
        # for one that is not there and every commit would hang (smtpguard answering 451,
        # sending nothing). Alone after the failover, it commits on its own, as a cluster
        # manager's non-strict synchronous mode does until the old primary rejoins.
        standby.configure(synchronous_standby_names="''")
        standby.start()
        wait_sync_standby(primary)
        url = (
            f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
            "?target_session_attrs=read-write"
        )
        port = free_port()
        cfg = base_config(tmp, upstream.port, instance="a", store__url=url)
        cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
        cfg["event_key"] = {
            "inflight_wait": "1s",
            "min_retry_interval": "1s",
            "lease": f"{LEASE:g}s",
            "strip": False,
        }
        cfg["zones"]["acme"]["plan"] = "unlimited"
        cfg["zones"]["acme"]["hourly_cap"] = 1_000_000
        cfg["zones"]["acme"]["monthly_cap"] = 1_000_000
        guard = GuardProcess(write_config(tmp / "a.yaml", cfg), tmp / "a.log")
        guard.start()
        await guard.wait_port(port)

        async def fail_over() -> None:
            await asyncio.to_thread(primary.kill)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(standby.promote)

        # Keys still open after the storm are retried until their lease has run out (then
        # they are retryable, or held as unknown) and a little more.
        count = await storm(port, upstream, fail_over, workers=WORKERS, settle=LEASE + 6.0, prefix="pgfo")
        store = PostgresStore(url)
        await store.open()
        try:
            states = {k: (r.state.value if (r := await store.get("acme", k)) else None) for k in count.held}
        finally:
            await store.close()
        print(f"postgres failover (primary kill -9, standby promoted 1 s later): {count.summary()}; "
              f"held states {states}; test ran {time.monotonic() - started:.1f} s")  # fmt: skip
        assert count.duplicates == {}
        assert count.lost == []
        assert count.first_250_after is not None, "no session reached the new primary"
        # Held: only events whose outcome write was lost after the dot may have gone.
        assert all(s == State.UNKNOWN.value for s in states.values()), states
        # In-flight sessions got 451 4.3.0 or their outcome; a client's own retry of a key
        # still leased meanwhile hears 451 4.7.1 (in flight).
        assert set(count.replies) <= {"451 4.3.0", "451 4.7.1"} | {k for k in count.replies if "client" in k}
        assert set(count.resent_answers) == {"250 duplicate"}
    except BaseException:
        if guard is not None:
            print(f"--- a.log ---\n{guard.log_path.read_text()[-4000:]}")
        raise
    finally:
        if guard is not None:
            await asyncio.to_thread(guard.stop)
        primary.remove()
        standby.remove()
