"""Schema upgrades and least privilege on PostgreSQL (DESIGN.md §18).

- A rolling upgrade: a store made by an earlier release's own migrations (its tree from
  `git archive`, run by this checkout's interpreter), grown to 100,000 records, while that
  release's `serve` keeps taking writes; this release migrates it at start (`serve`) or
  ahead (`smtpguard migrate`). The old instance's write latency meanwhile is measured and
  printed; every write must be answered 250 and reach the upstream once.
- A role with only SELECT, INSERT, UPDATE, DELETE (docs/stores.md) serves a current schema;
  on a schema that is behind, `serve` and `smtpguard migrate` refuse, naming the role.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from smtpguard.cli import main
from smtpguard.config import ConfigError, loads
from smtpguard.server import Server
from smtpguard.store.postgres.migrate import LATEST, MIGRATIONS
from tests.support import (
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.postgres import PostgresServer
from tests.support.releases import extract_release

pytestmark = pytest.mark.slow

RELEASES = {
    # The last commit whose schema was version 2 (before the throttle's migration 3). No
    # commit with schema 1 alone could serve PostgreSQL: the ledger-index builds of
    # migration 2 are measured below with a plain SQL writer instead.
    2: "2d6a1334416d93387567fb2db9cd66d27e123ee8",
    # The last commit whose schema was version 5 (before the one-statement reservation with a
    # user's unit, the units with a user's, and the refund of migration 6).
    5: "1d8bc9cf8eee6a070e49eab7923202c897eccee0",
}
RECORDS = 100_000


@pytest.fixture(scope="module")
def releases() -> Iterator[dict[int, Path]]:
    trees: dict[int, Path] = {}
    with tempfile.TemporaryDirectory(prefix="smtpguard-release-") as tmp:
        for version, commit in RELEASES.items():
            trees[version] = extract_release(commit, Path(tmp) / f"v{version}")
        yield trees


def database(server: PostgresServer, name: str) -> str:
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + f"/{name}"


def drop_database(server: PostgresServer, name: str) -> None:
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def version_of(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT max(version) FROM smtpguard_schema").fetchone()
    assert row is not None
    return int(row[0])


def config_for(tmp: Path, upstream_port: int | None, url: str, instance: str, port: int) -> dict[str, Any]:
    cfg = base_config(tmp, upstream_port, instance=instance, store__url=url)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    cfg["zones"]["acme"].update(plan="unlimited", hourly_cap=1_000_000, monthly_cap=1_000_000)
    return cfg


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def config_for_release(
    tmp: Path, upstream_port: int | None, url: str, instance: str, port: int, schema: int
) -> dict[str, Any]:
    return config_for(tmp, upstream_port, url, instance, port)


@pytest.fixture(scope="module")
def filled(
    postgres_server: PostgresServer, releases: dict[int, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[int], tuple[str, float]]]:
    """A template database per schema version: made by that release's `serve` (its own
    migrations, one record it wrote), then grown to RECORDS records. Each test copies it."""
    made: dict[int, tuple[str, float]] = {}

    def template(schema: int) -> tuple[str, float]:
        if schema in made:
            return made[schema]
        name = f"sg_tpl_v{schema}"
        url = database(postgres_server, name)
        tmp = tmp_path_factory.mktemp(f"release{schema}")
        port = free_port()
        cfg = config_for_release(tmp, None, url, "old", port, schema)
        old = GuardProcess(write_config(tmp / "old.yaml", cfg), tmp / "old.log", src=releases[schema])
        try:
            old.start()
            asyncio.run(old.wait_port(port, timeout=30))
            assert asyncio.run(send(port, message("seed"))).code == 250
        finally:
            old.stop()
        assert version_of(url) == schema, "the earlier release made its own schema"
        t = time.monotonic()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO events (zone, key, version, state, updated_at, data) "
                "SELECT zone, 'bulk:' || g, version, state, updated_at + g, "
                'replace(data, \'"key":"seed"\', \'"key":"bulk:\' || g || \'"\') '
                "FROM events, generate_series(1, %s) g WHERE key = 'seed'",
                (RECORDS,),
            )
            conn.execute("ANALYZE events")
            row = conn.execute("SELECT count(*) FROM events").fetchone()
        assert row is not None and int(row[0]) == RECORDS + 1
        made[schema] = (name, time.monotonic() - t)
        return made[schema]

    yield template
    for name, _ in made.values():
        drop_database(postgres_server, name)


@pytest.mark.parametrize(("schema", "how"), [(2, "serve"), (2, "migrate"), (5, "serve")])
async def test_a_store_of_an_earlier_release_is_migrated_while_that_release_keeps_serving(
    postgres_server: PostgresServer,
    releases: dict[int, Path],
    filled: Callable[[int], tuple[str, float]],
    tmp: Path,
    upstream: Upstream,
    schema: int,
    how: str,
) -> None:
    template, filled_in = await asyncio.to_thread(filled, schema)
    name = f"sg_upgrade_v{schema}_{how}"
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    url = postgres_server.url.rsplit("/", 1)[0] + f"/{name}"
    old_port = free_port()
    old = GuardProcess(
        write_config(tmp / "old.yaml", config_for_release(tmp, upstream.port, url, "old", old_port, schema)),
        tmp / "old.log",
        src=releases[schema],
    )
    new: GuardProcess | None = None
    try:
        old.start()
        await old.wait_port(old_port, timeout=30)
        assert version_of(url) == schema
        writes: list[tuple[float, float, int]] = []
        stop = asyncio.Event()

        async def writer(n: int) -> None:
            i = 0
            while not stop.is_set():
                started = time.monotonic()
                reply = await send(old_port, message(f"w{n}:{i}"), timeout=30)
                writes.append((started, time.monotonic(), reply.code))
                i += 1

        writers = [asyncio.create_task(writer(n)) for n in range(4)]
        await asyncio.sleep(0.5)
        new_port = free_port()
        new_cfg = write_config(tmp / "new.yaml", config_for(tmp, upstream.port, url, "new", new_port))
        t0 = time.monotonic()
        if how == "migrate":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = await asyncio.to_thread(main, ["migrate", "-c", str(new_cfg)])
            assert code == 0, out.getvalue()
            assert f"{schema} → {LATEST}" in out.getvalue()
        else:
            new = GuardProcess(new_cfg, tmp / "new.log")
            new.start()
            await new.wait_port(new_port, timeout=60)
        t1 = time.monotonic()
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*writers)
        assert version_of(url) == LATEST
        if new is None:
            new = GuardProcess(new_cfg, tmp / "new.log")
            new.start()
            await new.wait_port(new_port, timeout=30)
        # Both releases serve the one ledger: the new one answers the old one's writes.
        fresh = await send(new_port, message("after:new"))
        dup = await send(new_port, message("w0:0"))
        old_after = await send(old_port, message("after:old"))
    finally:
        if new is not None:
            await asyncio.to_thread(new.stop)
        await asyncio.to_thread(old.stop)
        drop_database(postgres_server, name)
    during = [end - start for start, end, _ in writes if end >= t0 and start <= t1]
    every = [end - start for start, end, _ in writes]
    print(
        f"upgrade from schema {schema} ({RECORDS} records, filled in {filled_in:.1f} s) by `{how}`: "
        f"migrated in {t1 - t0:.2f} s; the earlier release's writes during it: {len(during)}, "
        f"p50 {statistics.median(during) * 1000:.0f} ms, p99 {percentile(during, 0.99) * 1000:.0f} ms, "
        f"max {max(during) * 1000:.0f} ms; all {len(every)} writes: p50 "
        f"{statistics.median(every) * 1000:.0f} ms, p99 {percentile(every, 0.99) * 1000:.0f} ms, "
        f"max {max(every) * 1000:.0f} ms"
    )
    assert during, "no write of the earlier release overlapped the migration"
    assert [c for _, _, c in writes if c != 250] == []
    assert (fresh.code, dup.code, old_after.code) == (250, 250, 250)
    assert "duplicate" in dup.text
    keys = upstream.event_keys()
    assert len(keys) == len(set(keys)) == len(writes) + 2  # and after:new, after:old
    # A store call's deadline is 2 s: a write held longer would have been a 451.
    assert max(during) < 2.0


async def test_ledger_indexes_of_a_large_store_are_built_concurrently_while_writes_go_on(
    postgres_server: PostgresServer, tmp: Path, upstream: Upstream
) -> None:
    """Schema 1 (this release's own first migration) with RECORDS records: migration 2
    indexes the ledger three times. Built inside the migration's transaction, each build
    holds every writer of the table for as long as it runs; built concurrently, a writer
    (plain INSERTs, as any release writes a reservation) goes on."""
    name = "sg_upgrade_v1"
    url = database(postgres_server, name)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE smtpguard_schema (version integer NOT NULL)")
            conn.execute(MIGRATIONS[0].encode())
            conn.execute("INSERT INTO smtpguard_schema (version) VALUES (1)")
            conn.execute(
                "INSERT INTO events (zone, key, version, state, updated_at, data) "
                "SELECT 'acme', 'bulk:' || g, 1, 'delivered', g, "
                '\'{"zone":"acme","key":"bulk:\' || g || \'","sg_id":"sg\' || g || \'"}\' '
                "FROM generate_series(1, %s) g",
                (RECORDS,),
            )
            conn.execute("ANALYZE events")
        latencies: list[float] = []
        stop = asyncio.Event()

        async def writer() -> None:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                i = 0
                while not stop.is_set():
                    started = time.monotonic()
                    await conn.execute(
                        "INSERT INTO events (zone, key, version, state, updated_at, data) "
                        "VALUES ('acme', %s, 1, 'in_flight', 0, '{}')",
                        (f"live:{i}",),
                    )
                    latencies.append(time.monotonic() - started)
                    i += 1
                    await asyncio.sleep(0.01)

        cfg = write_config(tmp / "new.yaml", config_for(tmp, upstream.port, url, "new", 0))
        task = asyncio.create_task(writer())
        await asyncio.sleep(0.3)
        out = io.StringIO()
        t0 = time.monotonic()
        with contextlib.redirect_stdout(out):
            code = await asyncio.to_thread(main, ["migrate", "-c", str(cfg), "--json"])
        took = time.monotonic() - t0
        stop.set()
        await task
        assert code == 0, out.getvalue()
        done = json.loads(out.getvalue())
        with psycopg.connect(url, autocommit=True) as conn:
            valid = conn.execute(
                "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE c.relname IN ('events_sid', 'events_zone_state', 'events_zone_updated')"
            ).fetchall()
    finally:
        drop_database(postgres_server, name)
    print(
        f"migrate 1 → {LATEST} over {RECORDS} records: {took:.2f} s, built concurrently "
        f"{done['concurrently']}; {len(latencies)} writes meanwhile: p50 "
        f"{statistics.median(latencies) * 1000:.1f} ms, p99 {percentile(latencies, 0.99) * 1000:.1f} ms, "
        f"max {max(latencies) * 1000:.0f} ms"
    )
    assert (done["from"], done["to"]) == (1, LATEST)
    assert sorted(done["concurrently"]) == ["events_sid", "events_zone_state", "events_zone_updated"]
    assert sorted(valid) == [("events_sid", True), ("events_zone_state", True), ("events_zone_updated", True)]
    # The writer never waited for a whole index build: the longest write is well under the
    # migration's own length.
    assert max(latencies) < max(took / 2, 0.2), (max(latencies), took)


DML_ROLE = "sg_dml"


def grant_dml(url: str) -> str:
    """The least-privilege role of docs/stores.md; its URL."""
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (DML_ROLE,)).fetchone() is None:
            conn.execute(f"CREATE ROLE {DML_ROLE} LOGIN")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {DML_ROLE}")
        conn.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {DML_ROLE}")
    return url.replace("://postgres@", f"://{DML_ROLE}@")


async def test_a_dml_only_role_serves_a_current_schema_and_is_refused_on_one_behind(
    postgres_server: PostgresServer, tmp: Path, upstream: Upstream
) -> None:
    name = "sg_dml_only"
    url = database(postgres_server, name)
    try:
        owner_cfg = write_config(tmp / "owner.yaml", config_for(tmp, upstream.port, url, "owner", 0))
        assert await asyncio.to_thread(main, ["migrate", "-c", str(owner_cfg)]) == 0
        dml_url = grant_dml(url)
        cfg = config_for(tmp, upstream.port, dml_url, "dml", 0)
        cfg["zones"]["acme"]["delivery"] = "queue"
        cfg["queue"] = {"poll_interval": "100ms", "backoff": {"base": "1s", "max": "2s"}}
        async with running_guard(cfg) as guard:
            queued = await send(guard.ports[0], message("dml:q"))
            cfg["zones"]["acme"]["delivery"] = "relay"
        async with running_guard(cfg) as guard:
            relayed = await send(guard.ports[0], message("dml:r"))
            dup = await send(guard.ports[0], message("dml:r"))
            await upstream.wait_received(2)
        assert queued.code == 250 and "queued" in queued.text, str(queued)
        assert relayed.code == 250 and dup.code == 250 and "duplicate" in dup.text
        assert sorted(upstream.event_keys()) == ["dml:q", "dml:r"]

        # The schema one version behind (as after a release whose migration has not run):
        # the DML role may not bring it up to date.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DELETE FROM smtpguard_schema WHERE version = %s", (LATEST,))
        with pytest.raises(ConfigError) as refused:
            server = Server(loads(write_config(tmp / "dml.yaml", cfg).read_text()))
            await server.start()
        assert f"role '{DML_ROLE}' may not change it" in str(refused.value)
        assert f"version {LATEST - 1}" in str(refused.value)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = await asyncio.to_thread(main, ["migrate", "-c", str(tmp / "dml.yaml")])
        assert code == 4 and f"role '{DML_ROLE}'" in err.getvalue(), err.getvalue()
    finally:
        drop_database(postgres_server, name)
