"""The application's database as a primary and its streaming standby, both named in the
outbox url, the standby first (as after a failover that swapped them). A url that does not
ask libpq for the read-write server lands on the standby, which refuses every claim: the
reader reconnected to it for ever, the primary a host away, and nothing was sent. Refused
at load, as the store's url is; with `target_session_attrs=read-write` the rows flow."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml

from smtpguard.config import ConfigError, loads
from smtpguard.outbox.schema import ddl
from tests.support import Upstream, eventually, running_guard
from tests.support.outbox import insert, outbox_config, receipts, row
from tests.support.postgres import PostgresServer


@contextlib.contextmanager
def primary_and_standby() -> Iterator[tuple[PostgresServer, PostgresServer]]:
    primary, standby = PostgresServer(name="app-primary"), PostgresServer(name="app-standby")
    try:
        primary.init(wal_keep_size="64MB")
        primary.start()
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute(ddl())  # type: ignore[arg-type]
        standby.base_backup_of(primary)
        standby.start()
        yield primary, standby
    finally:
        primary.remove()
        standby.remove()


def _url(*servers: PostgresServer, query: str = "") -> str:
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return f"postgresql://postgres@{hosts}/postgres{query}"


def test_a_url_of_several_hosts_without_read_write_is_refused(tmp: Path) -> None:
    for query in ("", "?target_session_attrs=any", "?target_session_attrs=standby"):
        cfg = outbox_config(tmp, 2525, "postgresql://app@db1,db2/shop" + query)
        with pytest.raises(ConfigError) as e:
            loads(yaml.safe_dump(cfg, sort_keys=False))
        assert "outbox.shop.url (line" in str(e.value) and "read-write" in str(e.value), str(e.value)
    for query in ("?target_session_attrs=read-write", "?target_session_attrs=primary"):
        cfg = outbox_config(tmp, 2525, "postgresql://app@db1,db2/shop" + query)
        assert loads(yaml.safe_dump(cfg, sort_keys=False)).outbox["shop"].url.endswith(query)


@pytest.mark.slow
async def test_the_standby_named_first_is_passed_over_for_the_primary(tmp: Path, upstream: Upstream) -> None:
    with primary_and_standby() as (primary, standby):
        url = _url(standby, primary, query="?target_session_attrs=read-write")
        async with running_guard(outbox_config(tmp, upstream.port, url)) as server:
            await insert(primary.url, [row("failover:1")])
            found = await eventually(
                lambda: receipts(primary.url),
                lambda f: f["failover:1"]["state"] == "sent",
                timeout=15,
                interval=0.05,
            )
            assert server.outbox[0].counters.outages == 0
    assert upstream.event_keys() == ["failover:1"]
    assert found["failover:1"]["state"] == "sent"
