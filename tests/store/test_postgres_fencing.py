"""Fencing remembers the newest timeline (DESIGN.md §18), counted at the upstream.

After a failover and the old primary's reflexive restart, the old primary is fenced while
the promoted server answers. When the promoted server then stops answering (a restart, a
moment cut off), the old primary is again the only server of the URL that accepts writes.
It is still on the older timeline and its ledger still lacks everything written since the
failover: written to, it answers "no record" for events already sent, and they are sent
again. A server on an older timeline of the cluster than one already seen is never
written; while nothing newer answers, sessions get 451 4.3.0 and nothing is sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import psycopg
import pytest

from smtpguard.cli import main
from tests.store.test_postgres_failover import guard_config, pair, url_of
from tests.support import Reply, Upstream, message, running_guard, send, write_config

pytestmark = pytest.mark.slow

KEYS = 5


async def test_the_old_primary_stays_fenced_while_the_promoted_one_is_away(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="smtpguard.store")
    with pair(synchronous=True) as (primary, standby):
        cfg = guard_config(tmp, upstream, url_of(primary, standby))
        path = write_config(tmp / "f.yaml", cfg)
        assert await asyncio.to_thread(main, ["migrate", "-c", str(path)]) == 0
        primary.kill()
        standby.promote()
        primary.configure(synchronous_standby_names="''")
        primary.start()
        cfg["store"]["unsafe"] = True
        # Two instances of a fleet; each has seen both servers, the old primary fenced.
        async with running_guard(cfg) as a, running_guard(cfg) as b:
            first = [await send(a.ports[0], message(f"away:{i}")) for i in range(KEYS)]
            assert [r.code for r in first] == [250] * KEYS, [str(r) for r in first]
            await upstream.wait_received(KEYS)
            fenced_before = caplog.text.count("postgresql servers fenced")
            lifted_before = caplog.text.count("postgresql fencing lifted")
            standby.stop()
            # Instance b retries the events a sent (as a client whose reply was lost does)
            # until its fence has decided again without the promoted server, plus one.
            again: list[Reply] = []
            deadline = time.monotonic() + 20
            decided_at: int | None = None
            while time.monotonic() < deadline and (decided_at is None or len(again) < decided_at + KEYS):
                again.append(await send(b.ports[0], message(f"away:{len(again) % KEYS}"), timeout=10))
                decided = (
                    caplog.text.count("postgresql servers fenced") > fenced_before
                    or caplog.text.count("postgresql fencing lifted") > lifted_before
                )
                if decided and decided_at is None:
                    decided_at = len(again)
                if again[-1].code != 250:
                    await asyncio.sleep(0.2)
        assert decided_at is not None, "the fence never decided again after the promoted server stopped"
        with psycopg.connect(primary.url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM events WHERE key LIKE 'away:%'").fetchone()
    sent = upstream.event_keys()
    codes = sorted({r.code for r in again})
    print(f"after the promoted server stopped: {len(again)} retries, replies {codes}")
    assert sorted(sent) == sorted(f"away:{i}" for i in range(KEYS)), f"sent twice: {sorted(sent)}"
    assert row == (0,), "the old primary's ledger was written"
    assert all(r.code == 451 and r.text.startswith("4.3.0") for r in again), [str(r) for r in again]
    assert "older timeline" in caplog.text
