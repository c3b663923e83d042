"""Failover of the PostgreSQL store (DESIGN.md §15, §18), counted at the upstream.

A primary and a streaming standby (`pg_basebackup -R`) on loopback ports, run
unprivileged. smtpguard holds the libpq multi-host URL of both with
`target_session_attrs=read-write`.

- The storm: clients submit distinct keys as fast as they are answered and retry the same
  key on a 4xx, as a mail client does. Mid-storm the primary is killed with `kill -9`; 1 s
  or 12 s later the standby is promoted. Counted: duplicates at the upstream (must be 0),
  client 250s that never reached the upstream (lost: must be 0), records left `unknown`
  whose message never reached the upstream (never sent, yet unknown: must be 0), and the
  keys still held at the end, each `unknown` (its outcome write was lost with the primary).
- An asynchronous standby: `serve` refuses to start (naming the setting), unless
  `store.unsafe`.
- Fencing: after a failover, the old primary restarted read-write; both accept writes, and
  only the promoted one (the newer timeline) is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from smtpguard.cli import main
from smtpguard.config import loads
from smtpguard.policy.ledger import State
from smtpguard.readiness.store import store_findings
from smtpguard.store import StoreUnavailable
from smtpguard.store.postgres import PostgresStore
from tests.support import (
    OTHER_PASSWORD,
    Behaviour,
    GuardProcess,
    Reply,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.eventually import eventually
from tests.support.failover import storm
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.slow

WORKERS = 16
LEASE = 4.0


def wait_standby(primary: PostgresServer, sync_state: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with psycopg.connect(primary.url, autocommit=True) as conn:
            row = conn.execute("SELECT sync_state FROM pg_stat_replication").fetchone()
        if row is not None and row[0] == sync_state:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the standby did not become {sync_state}")


@contextlib.contextmanager
def pair(synchronous: bool) -> Iterator[tuple[PostgresServer, PostgresServer]]:
    primary, standby = PostgresServer(name="primary"), PostgresServer(name="standby")
    try:
        sync = {"synchronous_standby_names": "'*'", "synchronous_commit": "on"} if synchronous else {}
        primary.init(wal_keep_size="64MB", **sync)
        primary.start()
        standby.base_backup_of(primary)
        # Its copy of postgresql.conf names a synchronous standby too: promoted, it would wait
        # for one that is not there and every commit would hang (smtpguard answering 451,
        # sending nothing). Alone after the failover, it commits on its own, as a cluster
        # manager's non-strict synchronous mode does until the old primary rejoins.
        standby.configure(synchronous_standby_names="''")
        standby.start()
        wait_standby(primary, "sync" if synchronous else "async")
        yield primary, standby
    finally:
        primary.remove()
        standby.remove()


def url_of(*servers: PostgresServer) -> str:
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"


def guard_config(tmp: Path, upstream: Upstream, url: str, delivery: str = "relay") -> dict[str, Any]:
    cfg = base_config(tmp, upstream.port, instance="a", store__url=url)
    cfg["event_key"] = {
        "inflight_wait": "1s",
        "min_retry_interval": "1s",
        "lease": f"{LEASE:g}s",
        "strip": False,
    }
    zone = cfg["zones"]["acme"]
    zone.update(plan="unlimited", hourly_cap=1_000_000, monthly_cap=1_000_000, delivery=delivery)
    if delivery == "queue":
        cfg["queue"] = {"poll_interval": "100ms", "backoff": {"base": "1s", "max": "2s"}}
    return cfg


def mixed_config(tmp: Path, upstream: Upstream, url: str) -> dict[str, Any]:
    """Both modes in one storm: zone acme relays, zone globex stores and forwards."""
    cfg = guard_config(tmp, upstream, url)
    cfg["zones"]["globex"].update(
        plan="unlimited", hourly_cap=1_000_000, monthly_cap=1_000_000, delivery="queue"
    )
    cfg["queue"] = {"poll_interval": "100ms", "backoff": {"base": "1s", "max": "2s"}}
    return cfg


def zone_of(key: str) -> str:
    return "acme" if int(key.rsplit(":", 1)[1]) % 2 else "globex"


@pytest.mark.parametrize("promote_after", [1.0, 12.0])
async def test_primary_killed_mid_storm_standby_promoted_nothing_twice_nothing_lost(
    tmp: Path, upstream: Upstream, promote_after: float
) -> None:
    started = time.monotonic()
    # The provider takes a moment after the dot, so sessions are between the data_sent note
    # and the outcome write when the primary dies.
    upstream.handler.default = Behaviour(hang_after_dot=0.05)
    guard: GuardProcess | None = None
    with pair(synchronous=True) as (primary, standby):
        url = url_of(primary, standby)
        states = PostgresStore(url)
        try:
            port = free_port()
            cfg = mixed_config(tmp, upstream, url)
            cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
            guard = GuardProcess(write_config(tmp / "a.yaml", cfg), tmp / "a.log")
            guard.start()
            await guard.wait_port(port)
            await states.open()
            # The schema is migrated at open, in the background, by this store and by the
            # guard at once, each commit waiting for the synchronous standby: on a loaded
            # machine that outlasted the first ping (not ready, no replication facts seen).
            assert await eventually(states.ping, timeout=60, interval=0.2), "the store answers"
            assert states.synchronous is True, "the standby streams synchronously"

            async def fail_over() -> None:
                await asyncio.to_thread(primary.kill)
                await asyncio.sleep(promote_after)
                await asyncio.to_thread(standby.promote)

            async def submit(key: str) -> Reply:
                if zone_of(key) == "acme":
                    return await send(port, message(key), timeout=60)
                sender = "billing@globex.example"
                return await send(
                    port, message(key, sender=sender), user="globex-app", password=OTHER_PASSWORD,
                    sender=sender, timeout=60,
                )  # fmt: skip

            async def drain() -> None:
                # Store-and-forward: every queued entry delivered (or held) before counting.
                deadline = time.monotonic() + 30
                counts: dict[str, int] = {}
                while time.monotonic() < deadline:
                    with contextlib.suppress(StoreUnavailable):
                        counts = await states.state_counts("globex")
                        if not counts.get(State.QUEUED.value) and not counts.get(State.IN_FLIGHT.value):
                            return
                    await asyncio.sleep(0.2)
                raise AssertionError(f"the queue did not drain within 30 s: {counts}")

            # Keys still open after the storm are retried until their lease has run out (then
            # they are retryable, or held as unknown) and a little more.
            count = await storm(
                port, upstream, fail_over, workers=WORKERS, settle=LEASE + 6.0, prefix="pgfo",
                before=1.5, after=3.0, drain=drain, submit=submit,
            )  # fmt: skip
            # After the failover: writing on, and known to be without a synchronous standby.
            deadline = time.monotonic() + 8
            while states.synchronous is not False and time.monotonic() < deadline:
                await states.ping()
                await asyncio.sleep(0.2)
            assert states.synchronous is False
            held: dict[str, str | None] = {}
            for k in count.held:
                r = await states.get(zone_of(k), k)
                held[k] = r.state.value if r else None
            unknown = [
                r
                for zone in ("acme", "globex")
                for r in await states.list_records(zone, State.UNKNOWN.value, None, None, 100_000)
            ]
            queued = sum(1 for k in count.ok if zone_of(k) == "globex")
            sent = set(upstream.event_keys())
            never_sent_unknown = sorted(r.key for r in unknown if r.key not in sent)
            print(
                f"postgres failover (relay and queue; primary kill -9, standby promoted "
                f"{promote_after:g} s later): {count.summary()}; of the 250s {queued} queued; held "
                f"states {held}; unknown {len(unknown)}, of them never sent {len(never_sent_unknown)}; "
                f"test ran {time.monotonic() - started:.1f} s"
            )
            assert count.duplicates == {}
            assert count.lost == []
            assert never_sent_unknown == []
            assert queued > 0 and len(count.ok) - queued > 0
            assert count.first_250_after is not None, "no session reached the new primary"
            # Held: only events whose outcome write was lost after the dot may have gone.
            assert all(s == State.UNKNOWN.value for s in held.values()), held
            # In-flight sessions got 451 4.3.0 or their outcome; a client's own retry of a key
            # still leased meanwhile hears 451 4.7.1 (in flight).
            expected = {"451 4.3.0", "451 4.7.1"}
            assert set(count.replies) <= expected | {k for k in count.replies if "client" in k}
            assert all("duplicate" in a for a in count.resent_answers), count.resent_answers
        except BaseException:
            if guard is not None:
                print(f"--- a.log ---\n{guard.log_path.read_text()[-4000:]}")
            raise
        finally:
            await states.close()
            if guard is not None:
                await asyncio.to_thread(guard.stop)


def serve(path: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["serve", "-c", str(path)])
    return code, err.getvalue()


async def test_an_asynchronous_standby_is_refused_at_start_unless_unsafe(
    tmp: Path, upstream: Upstream
) -> None:
    with pair(synchronous=False) as (primary, standby):
        url = url_of(primary, standby)
        cfg = guard_config(tmp, upstream, url)
        code, err = await asyncio.to_thread(serve, write_config(tmp / "async.yaml", cfg))
        assert code == 1, err
        assert "synchronous_standby_names is empty" in err and "store.unsafe" in err, err
        # The same with synchronous_commit that does not wait for the standby.
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'local'")
            conn.execute("SELECT pg_reload_conf()")
        code, err = await asyncio.to_thread(serve, tmp / "async.yaml")
        assert code == 1 and "synchronous_commit is 'local'" in err, err
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
            conn.execute("ALTER SYSTEM RESET synchronous_commit")
            conn.execute("SELECT pg_reload_conf()")
        cfg["store"]["unsafe"] = True
        async with running_guard(cfg) as guard:
            first = await send(guard.ports[0], message("async:1"))
            again = await send(guard.ports[0], message("async:1"))
        assert first.code == 250 and again.code == 250 and "duplicate" in again.text
        assert upstream.event_keys() == ["async:1"]


async def test_an_old_primary_restarted_read_write_is_fenced(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="smtpguard.store")
    with pair(synchronous=True) as (primary, standby):
        url = url_of(primary, standby)
        cfg = guard_config(tmp, upstream, url)
        # The fleet's schema, made before the failover (and replicated).
        path = write_config(tmp / "f.yaml", cfg)
        assert await asyncio.to_thread(main, ["migrate", "-c", str(path)]) == 0
        primary.kill()
        standby.promote()
        # The reflexive restart: the old primary comes back read-write on its own copy (it
        # would wait for a synchronous standby that is gone; the operator cleared that too).
        primary.configure(synchronous_standby_names="''")
        primary.start()
        with psycopg.connect(primary.url, autocommit=True) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
        # libpq would take the old primary: it is first in the URL and accepts writes. Its
        # standby is gone with the failover: serving takes unsafe, which never turns
        # fencing off.
        cfg["store"]["unsafe"] = True
        async with running_guard(cfg) as guard:
            replies = [await send(guard.ports[0], message(f"fence:{i}")) for i in range(20)]
            again = await send(guard.ports[0], message("fence:0"))
            assert guard.store is not None
            assert getattr(guard.store, "synchronous", None) is False
            metrics = guard.metrics.render().decode()
        assert 'smtpguard_store_synchronous{store="postgresql"} 0.0' in metrics
        findings = await store_findings(loads(write_config(path, cfg).read_text()))
        on_old = _count(primary, "fence:%")
        on_new = _count(standby, "fence:%")
    assert [r.code for r in replies] == [250] * 20, [str(r) for r in replies]
    assert again.code == 250 and "duplicate" in again.text
    assert sorted(upstream.event_keys()) == sorted(f"fence:{i}" for i in range(20))
    assert (on_old, on_new) == (0, 20)
    fenced = [r for r in caplog.records if r.getMessage() == "postgresql servers fenced"]
    assert fenced and fenced[0].__dict__["fenced"] == [f"127.0.0.1:{primary.port}"]
    assert "no synchronous standby" in caplog.text
    assert [f.status for f in findings] == ["error", "error"], findings
    assert "fenced" in findings[0].detail and "synchronous_standby_names" in findings[1].detail


def _count(server: PostgresServer, pattern: str) -> int:
    with psycopg.connect(server.url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM events WHERE key LIKE %s", (pattern,)).fetchone()
    assert row is not None
    return int(row[0])


async def test_two_writable_servers_that_cannot_be_told_apart_are_written_to_neither(
    tmp: Path, upstream: Upstream, postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two clusters (two system identifiers) both accepting writes: which holds the fleet's
    ledger cannot be known, so neither is written (the same as two servers on one timeline,
    policy/fencing.py): 451 4.3.0, nothing sent."""
    caplog.set_level(logging.INFO, logger="smtpguard.store")
    other = PostgresServer(name="other")
    try:
        other.init()
        other.start()
        cfg = guard_config(tmp, upstream, url_of(postgres_server, other))
        cfg["store"]["unsafe"] = True
        async with running_guard(cfg) as guard:
            reply = await send(guard.ports[0], message("twins:1"))
        findings = await store_findings(loads(write_config(tmp / "t.yaml", cfg).read_text()))
    finally:
        other.remove()
    assert reply.code == 451 and reply.text.startswith("4.3.0"), str(reply)
    assert upstream.event_keys() == []
    assert "servers of different clusters accept writes" in caplog.text
    assert findings[0].status == "error" and "different clusters" in findings[0].detail
