"""Migration 6's one-statement steps (smtpguard_reserve_user, smtpguard_count_units,
smtpguard_refund) beside the previous release's several-statement ones, on one PostgreSQL
store: the release before them (its tree from `git archive`, run in a process of its own
by this checkout's interpreter) and this one reserve, count and refund at once under one
user's caps and one zone's; a refund races a purge; the least-privileged roles of
docs/stores.md migrate and serve. Every unit is counted from the tables themselves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, Record, Submission
from smtpguard.policy.limits import CapCheck, CapReached, Caps, cap_check, month_of
from smtpguard.store import CapUsage, Reserved, store_from_url
from smtpguard.store.postgres import PostgresStore
from smtpguard.store.postgres.migrate import LATEST
from tests.store.test_postgres_upgrade import database, drop_database
from tests.support import (
    OTHER_PASSWORD,
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    message,
    send,
    write_config,
)
from tests.support.postgres import PostgresServer
from tests.support.releases import extract_release

pytestmark = pytest.mark.slow

PREVIOUS = "1d8bc9cf8eee6a070e49eab7923202c897eccee0"
"""The last commit before migration 6 (schema 5, as test_postgres_upgrade's RELEASES[5]): its
store makes the same calls in several statements. A commit, not a branch name: a clone may
have no `main`, and once this lands `main` is no longer the release before."""
NOW = 1_790_000_000.0
MONTH = month_of(NOW)

# The previous release's side: one JSON command a line on stdin, one JSON answer a line.
_OLD = r"""
import asyncio, json, sys
from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, Submission
from smtpguard.policy.limits import Caps, cap_check
from smtpguard.store import Reserved, store_from_url
from smtpguard.store.postgres.migrate import LATEST

def fresh(zone, key, now):
    sub = Submission(zone, key, "fp:" + key, "att:" + key, "old", None)
    return ledger.decide(None, sub, now, LedgerSettings()).record

def check(c, now):
    user = c.get("user")
    return cap_check(c["zone"], Caps(c["zone_hourly"], c["zone_monthly"]), c["token"], now,
                     user, Caps(c["hourly"], c["monthly"]) if user else None)

def said(r):
    if r is None or isinstance(r, Reserved):
        return "ok"
    if type(r).__name__ == "CapReached":
        return f"{r.window}:{r.cap}:{r.user or ''}"
    return type(r).__name__

async def run(store, cmd):
    now = cmd["now"]
    async def one(op, c):
        try:
            if op == "reserve":
                return said(await store.reserve(fresh(c["zone"], c["key"], now), None, check(c, now), False))
            if op == "consume":
                return said(await store.consume_cap(check(c, now)))
            if op == "refund":
                await store.refund(c["zone"], c["token"], c["month"])
                return "ok"
            if op == "purge":
                await store.purge(now, 30 * 86400.0)
                return "ok"
        except Exception as e:
            return "error:" + repr(e)
    groups = [asyncio.gather(*(one(op, c) for c in calls)) for op, calls in cmd["groups"]]
    return await asyncio.gather(*groups)

async def main():
    store = store_from_url(sys.argv[1])
    await store.open()
    print(json.dumps({"latest": LATEST}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        print(json.dumps(await run(store, json.loads(line))), flush=True)
    await store.close()

asyncio.run(main())
"""


class Previous:
    """The previous release's store, in a process of its own."""

    def __init__(self, src: Path, url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _OLD, url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(src),
        )  # fmt: skip
        self.latest = json.loads(self._line())["latest"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the previous release's store exited"
        return line

    async def run(self, op: str, calls: list[dict[str, Any]], now: float = NOW) -> list[str]:
        return (await self.run_together([(op, calls)], now))[0]

    async def run_together(
        self, groups: list[tuple[str, list[dict[str, Any]]]], now: float = NOW
    ) -> list[list[str]]:
        """Groups of calls run at once on the previous release's side (one command at a
        time goes down the pipe, so that its answer is the next line)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"groups": groups, "now": now}) + "\n")
        self.proc.stdin.flush()
        answer: list[list[str]] = json.loads(await asyncio.to_thread(self._line))
        return answer

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def previous_tree() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="smtpguard-release-") as tmp:
        yield extract_release(PREVIOUS, Path(tmp))


@pytest.fixture
async def both(
    postgres_server: PostgresServer, previous_tree: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[PostgresStore, Previous, str]]:
    name = "sg_" + request.node.name[5:40].lower()
    url = database(postgres_server, name)
    new = store_from_url(url)
    await new.open()  # migrates to LATEST; the previous release then serves the same schema
    assert isinstance(new, PostgresStore)
    old = await asyncio.to_thread(Previous, previous_tree, url)
    try:
        assert old.latest == LATEST - 1
        yield new, old, url
    finally:
        old.close()
        await new.close()
        drop_database(postgres_server, name)


def call(
    key: str, zone: str = "acme", user: str | None = None, hourly: int = 1000, monthly: int = 100_000,
    zone_hourly: int = 1000, zone_monthly: int = 100_000,
) -> dict[str, Any]:  # fmt: skip
    return {
        "zone": zone, "key": key, "token": "t:" + key, "user": user, "hourly": hourly,
        "monthly": monthly, "zone_hourly": zone_hourly, "zone_monthly": zone_monthly, "month": MONTH,
    }  # fmt: skip


def check_of(c: dict[str, Any], now: float = NOW) -> CapCheck:
    user = c["user"]
    caps = Caps(c["hourly"], c["monthly"]) if user else None
    return cap_check(c["zone"], Caps(c["zone_hourly"], c["zone_monthly"]), c["token"], now, user, caps)


def record(c: dict[str, Any], now: float = NOW) -> Record:
    sub = Submission(c["zone"], c["key"], "fp:" + c["key"], "att:" + c["key"], "new", None)
    verdict = ledger.decide(None, sub, now, LedgerSettings())
    assert isinstance(verdict, ledger.Proceed)
    return verdict.record


def said(r: object) -> str:
    if r is None or isinstance(r, Reserved):
        return "ok"
    if isinstance(r, CapReached):
        return f"{r.window}:{r.cap}:{r.user or ''}"
    return type(r).__name__


async def new_run(store: PostgresStore, op: str, calls: list[dict[str, Any]], now: float = NOW) -> list[str]:
    async def one(c: dict[str, Any]) -> str:
        try:
            if op == "reserve":
                return said(await store.reserve(record(c, now), None, check_of(c, now), False))
            if op == "consume":
                return said(await store.consume_cap(check_of(c, now)))
            if op == "refund":
                await store.refund(c["zone"], c["token"], c["month"])
                return "ok"
            await store.purge(now, 30 * 86400.0)
            return "ok"
        except Exception as e:
            return "error:" + repr(e)

    return list(await asyncio.gather(*(one(c) for c in calls)))


async def at_once(
    new: PostgresStore, old: Previous, op: str, new_calls: list[dict[str, Any]],
    old_calls: list[dict[str, Any]], now: float = NOW,
) -> tuple[list[str], list[str]]:  # fmt: skip
    a, b = await asyncio.gather(new_run(new, op, new_calls, now), old.run(op, old_calls, now))
    return a, b


async def each_side(
    new: PostgresStore,
    old: Previous,
    op: str,
    prefix: str,
    n: int,
    make: Callable[[str, int], dict[str, Any]],
) -> tuple[list[str], list[str]]:
    """n calls on each side at once, keys n<prefix><i> on this release's, o<prefix><i> on the other."""
    return await at_once(
        new,
        old,
        op,
        [make(f"n{prefix}{i}", i) for i in range(n)],
        [make(f"o{prefix}{i}", i) for i in range(n)],
    )


def counted(url: str) -> dict[str, Any]:
    """What the tables hold, and whether each kept count agrees with the rows it counts."""
    with psycopg.connect(url, autocommit=True) as conn:
        q = conn.execute
        return {
            "sends": dict(q("SELECT zone, count(*) FROM sends GROUP BY zone").fetchall()),
            "slots_agree": q(
                "SELECT coalesce(bool_and(s.n = coalesce(c.k, 0)), true) FROM cap_slots s LEFT JOIN "
                "(SELECT zone, slot, count(*) AS k FROM sends GROUP BY zone, slot) c USING (zone, slot)"
            ).fetchone()[0],
            "monthly": dict(q("SELECT zone, sum(used)::bigint FROM monthly GROUP BY zone").fetchall()),
            "user_sends": dict(q("SELECT username, count(*) FROM user_sends GROUP BY username").fetchall()),
            "user_monthly": dict(q("SELECT username, sum(used)::bigint FROM user_monthly GROUP BY username")),
        }


async def test_both_releases_count_one_users_units_once_and_refund_them_once(
    both: tuple[PostgresStore, Previous, str],
) -> None:
    new, old, url = both
    # 15 reservations on each side at once under one user's hourly cap of 7.
    a, b = await each_side(new, old, "reserve", "", 15, lambda k, _: call(k, user="svc", hourly=7))
    assert sorted(set(a + b)) == ["hour:7:svc", "ok"], (a, b)
    assert (a + b).count("ok") == 7, (a, b)
    won = [f"n{i}" for i, r in enumerate(a) if r == "ok"] + [f"o{i}" for i, r in enumerate(b) if r == "ok"]
    assert await new.cap_usage("acme", NOW, MONTH) == CapUsage(7, 7)
    assert await new.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(7, 7)}

    # Refunds from both sides, each token refunded twice, and each side refunding the
    # other's units: four units back, not eight.
    back = won[:4]
    a, b = await at_once(
        new, old, "refund", [call(k) for k in back[:2] + back[2:]], [call(k) for k in back[2:] + back[:2]]
    )
    assert a + b == ["ok"] * 8
    assert await new.cap_usage("acme", NOW, MONTH) == CapUsage(3, 3)
    assert await new.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(3, 3)}

    # Exactly the four refunded units are taken again, from both sides at once.
    a, b = await each_side(new, old, "reserve", "2", 10, lambda k, _: call(k, user="svc", hourly=7))
    assert (a + b).count("ok") == 4, (a, b)

    # The user's monthly cap, and the cap counts of consume_cap (the units of
    # store-and-forward) with a user's unit: smtpguard_count_units beside two statements.
    a, b = await each_side(new, old, "reserve", "m", 10, lambda k, _: call(k, user="mon", monthly=5))
    assert (a + b).count("ok") == 5 and set(a + b) == {"ok", "month:5:mon"}, (a, b)
    a, b = await each_side(new, old, "consume", "c", 10, lambda k, _: call(k, user="cc", hourly=6))
    assert (a + b).count("ok") == 6 and set(a + b) == {"ok", "hour:6:cc"}, (a, b)

    # The zone's own caps, hourly and monthly, with and without a user cap on the unit.
    a, b = await each_side(
        new,
        old,
        "reserve",
        "g",
        15,
        lambda k, i: call(k, zone="globex", user="u" if i % 2 else None, zone_hourly=9),
    )
    assert (a + b).count("ok") == 9 and set(a + b) == {"ok", "hour:9:"}, (a, b)
    with_user = sum(1 for results in (a, b) for i, r in enumerate(results) if r == "ok" and i % 2)
    a, b = await each_side(
        new, old, "consume", "i", 10, lambda k, _: call(k, zone="initech", user="u", zone_monthly=4)
    )
    assert (a + b).count("ok") == 4 and set(a + b) == {"ok", "month:4:"}, (a, b)

    got = counted(url)
    assert got["slots_agree"]
    assert got["sends"] == {"acme": 7 + 5 + 6, "globex": 9, "initech": 4}
    assert got["monthly"] == got["sends"]
    assert got["user_sends"] == {"svc": 7, "mon": 5, "cc": 6, "u": with_user + 4}
    assert got["user_monthly"] == got["user_sends"]


async def test_both_releases_reserving_refunding_and_purging_at_once_never_deadlock(
    both: tuple[PostgresStore, Previous, str],
) -> None:
    """Two lock orders in one store, had they differed: the previous release's refund (seven
    statements), this one's (one), reservations and counts with a user's unit on both sides,
    and each side's purge taking every slot row."""
    new, old, url = both
    rng = random.Random(6)
    errors: list[str] = []
    won: list[str] = []
    started = time.monotonic()
    rounds = 0
    while time.monotonic() - started < 6:
        users = ["a", "b", None]
        # The zone's hourly cap fills too: its counts then lock every slot row in order.
        new_calls = [
            call(f"n{rounds}:{i}", user=rng.choice(users), hourly=40, zone_hourly=150) for i in range(12)
        ]
        old_calls = [
            call(f"o{rounds}:{i}", user=rng.choice(users), hourly=40, zone_hourly=150) for i in range(12)
        ]
        refunds = rng.sample(won, min(len(won), 8))
        old_second = ("refund", [call(k) for k in refunds[4:]]) if rounds % 2 else ("purge", [{}])
        new_second = (
            ("purge", [{}])
            if rounds % 3 == 0
            else ("consume", [call(f"c{rounds}", user="a", hourly=40, zone_hourly=150)])
        )
        a, c, e, f, (b, d) = await asyncio.gather(
            new_run(new, "reserve", new_calls),
            new_run(new, "refund", [call(k) for k in refunds[:4]]),
            new_run(new, *new_second),
            new_run(new, "refund", [call(k) for k in refunds[4:]]),
            old.run_together([("reserve", old_calls), old_second]),
        )  # fmt: skip
        for results in (a, b, c, d, e, f):
            errors += [r for r in results if r.startswith("error")]
        won += [k["key"] for k, r in zip(new_calls + old_calls, a + b, strict=True) if r == "ok"]
        for k in refunds:
            won.remove(k)
        rounds += 1
    got = counted(url)
    print(f"{rounds} rounds of 24 reservations, 8 refunds and a purge or a count, both releases: {got}")
    assert errors == []
    assert got["slots_agree"]
    assert got["monthly"] == got["sends"]
    assert got["user_monthly"] == got["user_sends"]
    usage = await new.user_cap_usage("acme", ["a", "b"], NOW, MONTH)
    assert {u: x.hour for u, x in usage.items()} == {u: got["user_sends"].get(u, 0) for u in ("a", "b")}
    assert all(x.hour <= 40 for x in usage.values())
    assert 0 < got["sends"]["acme"] <= 150


async def test_a_refund_racing_a_purge_returns_each_unit_once(postgres_server: PostgresServer) -> None:
    name = "sg_refund_purge"
    url = database(postgres_server, name)
    store = store_from_url(url)
    await store.open()
    assert isinstance(store, PostgresStore)
    try:
        # A purge that deletes nothing of the window (every slot row locked all the same),
        # then one that deletes all of it while the refunds run.
        for i, purge_at in enumerate((NOW, NOW + 2 * 3600 + 1)):
            calls = [call(f"k{i}:{j}", user="svc", hourly=100) for j in range(40)]
            assert await new_run(store, "reserve", calls) == ["ok"] * 40
            together = await asyncio.gather(
                new_run(store, "refund", calls), *(new_run(store, "purge", [{}], purge_at) for _ in range(3))
            )
            assert [r for results in together for r in results] == ["ok"] * 43
            got = counted(url)
            assert got["slots_agree"] and got["sends"] == {} and got["user_sends"] == {}
            if i == 0:  # every refund found its unit: all given back
                assert got["monthly"] == {"acme": 0} and got["user_monthly"] == {"svc": 0}
            else:  # a unit the purge took first is not given back; one refunded first is, under both
                assert 0 <= got["monthly"]["acme"] <= 40
                assert got["user_monthly"] == {"svc": got["monthly"]["acme"]}
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("TRUNCATE events, sends, cap_slots, monthly, user_sends, user_monthly")
    finally:
        await store.close()
        drop_database(postgres_server, name)


def role_url(url: str, role: str) -> str:
    return url.replace("://postgres@", f"://{role}@")


async def test_the_owner_migrates_and_the_dml_role_serves_both_releases(
    postgres_server: PostgresServer, previous_tree: Path
) -> None:
    """docs/stores.md: one role owns the schema and runs the migrations, the fleet serves
    with SELECT, INSERT, UPDATE, DELETE. Schema 5 made by the previous release as the owner,
    the grants given then; this release's migration 6 run by the owner (no new table, so no
    new grant); both releases then serve with the DML role, user caps, counts and refunds."""
    name = "sg_roles6"
    url = database(postgres_server, name)
    with psycopg.connect(url, autocommit=True) as conn:
        for role in ("sg_owner6", "sg_dml6", "sg_other6"):
            conn.execute(f"DROP ROLE IF EXISTS {role}")
            conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute("GRANT CREATE ON SCHEMA public TO sg_owner6")
    try:
        old = await asyncio.to_thread(Previous, previous_tree, role_url(url, "sg_owner6"))
        old.close()
        assert old.latest == LATEST - 1
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SELECT max(version) FROM smtpguard_schema").fetchone() == (LATEST - 1,)
            conn.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO sg_dml6")
            conn.execute("GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO sg_dml6")
        owner = store_from_url(role_url(url, "sg_owner6"))
        await owner.open()
        await owner.close()
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SELECT max(version) FROM smtpguard_schema").fetchone() == (LATEST,)
            rows = conn.execute(
                "SELECT p.proname, r.rolname, p.prosecdef, "
                "has_function_privilege('sg_dml6', p.oid, 'EXECUTE') "
                "FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner "
                "WHERE p.proname LIKE 'smtpguard\\_%' ORDER BY 1"
            ).fetchall()
            # Invoker's rights (no SECURITY DEFINER to borrow the owner's) and callable by the DML role.
            assert all(owner_ == "sg_owner6" and not definer and may for _, owner_, definer, may in rows), (
                rows
            )
            assert {"smtpguard_reserve_user", "smtpguard_count_units", "smtpguard_refund"} <= {
                r[0] for r in rows
            }
            # Neither the DML role nor another role may put objects on the path ahead of them.
            for role in ("sg_dml6", "sg_other6"):
                assert conn.execute(
                    "SELECT has_schema_privilege(%s, 'public', 'CREATE')", (role,)
                ).fetchone() == (False,)
        dml = store_from_url(role_url(url, "sg_dml6"))
        await dml.open()
        assert isinstance(dml, PostgresStore)
        prev = await asyncio.to_thread(Previous, previous_tree, role_url(url, "sg_dml6"))
        try:
            a, b = await each_side(dml, prev, "reserve", "", 5, lambda k, _: call(k, user="svc", hourly=3))
            assert (a + b).count("ok") == 3 and set(a + b) == {"ok", "hour:3:svc"}, (a, b)
            won = [f"n{i}" for i, r in enumerate(a) if r == "ok"] + [
                f"o{i}" for i, r in enumerate(b) if r == "ok"
            ]
            a, b = await at_once(dml, prev, "refund", [call(won[0])], [call(won[1])])
            assert a + b == ["ok", "ok"]
            a, b = await at_once(
                dml, prev, "consume", [call("nc", user="svc", hourly=3)], [call("oc", user="svc", hourly=3)]
            )
            assert sorted(a + b) == ["ok", "ok"], (a, b)
            a, b = await at_once(dml, prev, "purge", [{}], [{}])
            assert a + b == ["ok", "ok"]
            assert await dml.user_cap_usage("acme", ["svc"], NOW, MONTH) == {"svc": CapUsage(3, 3)}
        finally:
            prev.close()
            await dml.close()
    finally:
        drop_database(postgres_server, name)
        with psycopg.connect(postgres_server.url, autocommit=True) as conn:
            for role in ("sg_owner6", "sg_dml6", "sg_other6"):
                conn.execute(f"DROP ROLE IF EXISTS {role}")


WIRE_CAP = 6
WIRE_TRIES = 14


def wire_config(tmp: Path, upstream: Upstream, url: str, instance: str, port: int) -> Path:
    cfg = base_config(tmp, upstream.port, instance=instance, store__url=url)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    # acme: the user's own hourly cap is the one that fills; globex: the zone's.
    cfg["zones"]["acme"].update(plan="unlimited", hourly_cap=1000, monthly_cap=1000)
    cfg["zones"]["acme"]["users"][0]["hourly_cap"] = WIRE_CAP
    cfg["zones"]["globex"].update(plan="unlimited", hourly_cap=WIRE_CAP, monthly_cap=1000)
    return write_config(tmp / f"{instance}.yaml", cfg)


async def test_both_releases_serving_at_once_send_exactly_the_cap(
    postgres_server: PostgresServer, previous_tree: Path, tmp: Path, upstream: Upstream
) -> None:
    """All at once, half to each release: exactly the cap answered 250 and reaches the
    upstream, for a user's own hourly cap and for a zone's; every other try is the cap's 451."""
    name = "sg_wire6"
    url = database(postgres_server, name)
    old_port, new_port = free_port(), free_port()
    new = GuardProcess(wire_config(tmp, upstream, url, "new", new_port), tmp / "new.log")
    old = GuardProcess(wire_config(tmp, upstream, url, "old", old_port), tmp / "old.log", src=previous_tree)
    try:
        new.start()  # migrates to 6 first; the previous release then serves schema 6
        await new.wait_port(new_port, timeout=30)
        old.start()
        await old.wait_port(old_port, timeout=30)
        ports = (old_port, new_port)
        acme, globex = await asyncio.gather(
            asyncio.gather(*(send(ports[i % 2], message(f"pg6:acme:{i}")) for i in range(WIRE_TRIES))),
            asyncio.gather(
                *(
                    send(
                        ports[i % 2],
                        message(f"pg6:globex:{i}", sender="news@globex.example"),
                        user="globex-app",
                        password=OTHER_PASSWORD,
                        sender="news@globex.example",
                    )
                    for i in range(WIRE_TRIES)
                )
            ),
        )
        counts = counted(url)
    finally:
        await asyncio.to_thread(new.stop)
        await asyncio.to_thread(old.stop)
        drop_database(postgres_server, name)
    keys = upstream.event_keys()
    for zone, replies, refusal in (("acme", acme, "user acme-app"), ("globex", globex, "slot frees")):
        sent = [k for k in keys if k.startswith(f"pg6:{zone}:")]
        ok = [f"pg6:{zone}:{i}" for i, r in enumerate(replies) if r.code == 250]
        assert len(ok) == WIRE_CAP and sorted(sent) == sorted(ok), (zone, sent, [str(r) for r in replies])
        refused = [r for r in replies if r.code != 250]
        assert all(r.code == 451 and refusal in r.text for r in refused), [str(r) for r in refused]
    assert counts["sends"] == {"acme": WIRE_CAP, "globex": WIRE_CAP} and counts["slots_agree"]
    assert counts["user_sends"] == {"acme-app": WIRE_CAP}
