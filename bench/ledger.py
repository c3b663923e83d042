"""Ledger scaling: reserve/get latency through the real store classes at 1,000 keys and at
many keys, and the state size per record.

    .venv/bin/python -m bench.ledger                       # 1,000 and 100,000 keys
    .venv/bin/python -m bench.ledger --keys 1000000        # 1,000 and 1,000,000 keys
    .venv/bin/python -m bench.ledger --stores sqlite --ops 500

For each store and size: a fresh store is filled fast, outside smtpguard, with delivered
records written exactly as the store writes them (SQLite: executemany into `events`,
mirroring smtpguard/store/sqlite/rows.py `_save`; Redis: a pipeline writing the hash and index
layout of smtpguard/store/redis.py, using its own key and JSON helpers). Then, through
SQLiteStore/RedisStore, one operation at a time:
  get        store.get() of a random existing key (what a duplicate's second look costs)
  reserve    store.reserve() of a new key with a cap check (the durable write before relay)
  dup        store.reserve() of an existing delivered key (the Conflict a duplicate gets)
State size: SQLite file size (after a WAL checkpoint) / records; Redis used_memory delta /
records. redis-server runs with appendonly no (so reserve does not wait for an fsync).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import (
    HUGE_CAP,
    ROOT,
    Redis,
    install_sigterm,
    machine_info,
    workdir,
    write_result,
)
from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, Record, Submission
from smtpguard.policy.limits import Caps, cap_check
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.replies import Reply

ZONE = "acme"
SETTINGS = LedgerSettings()
CAPS = Caps(hourly=HUGE_CAP, monthly=HUGE_CAP)


def key_of(i: int) -> str:
    return f"invoice:acme:{i:09d}"


def delivered_record(key: str, now: float) -> Record:
    """A delivered record made the way smtpguard makes one: reserve, data_sent, settle."""
    sub = Submission(ZONE, key, "f" * 64, f"{int(now * 1000):011x}0badcafe", "bench-host:1", "<sg.x@bench>")
    proceed = ledger.decide(None, sub, now, SETTINGS)
    assert isinstance(proceed, ledger.Proceed)
    rec = ledger.mark_data_sent(proceed.record, sub.attempt_id, now, SETTINGS)
    assert rec is not None
    outcome = Outcome(
        Kind.DELIVERED,
        "primary",
        Reply(250, "2.0.0", "Ok: queued as 4XyZ12AbCd"),
        upstream_id="4XyZ12AbCd",
        accepted=("customer@example.com",),
    )
    return ledger.settle(rec, sub.attempt_id, "bench-host:1", outcome, now, SETTINGS, sub.message_id)


def new_record(key: str, now: float, i: int) -> Record:
    sub = Submission(ZONE, key, "e" * 64, f"{int(now * 1000):011x}{i:08x}", "bench-host:1", None)
    proceed = ledger.decide(None, sub, now, SETTINGS)
    assert isinstance(proceed, ledger.Proceed)
    return proceed.record


def templated(now: float) -> tuple[Record, str]:
    """One delivered record and its JSON with the key replaced by a placeholder."""
    marker = "@@KEY@@"
    rec = delivered_record(marker, now)
    data = json.dumps(rec.to_dict(), separators=(",", ":"))
    assert data.count(marker) == 1
    return rec, data


# --- bulk fill -------------------------------------------------------------------------------
def fill_sqlite(path: Path, n: int, now: float) -> float:
    rec, data = templated(now)
    head, tail = data.split("@@KEY@@")
    t0 = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("BEGIN")

        def rows() -> Iterator[tuple[str, str, int, str, float, str]]:
            for i in range(n):
                k = key_of(i)
                yield (ZONE, k, rec.version, rec.state.value, rec.updated_at, head + k + tail)

        # The statement of store/sqlite/rows.py _save (an upsert), fed in bulk.
        conn.executemany(
            "INSERT INTO events (zone, key, version, state, updated_at, data) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (zone, key) DO UPDATE SET version = excluded.version, state = excluded.state, "
            "updated_at = excluded.updated_at, data = excluded.data",
            rows(),
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return time.perf_counter() - t0


def fill_redis(port: int, n: int, now: float) -> float:
    import redis

    from smtpguard.store.redis import _record_key, _zone_key  # the layout RedisStore reads

    rec, data = templated(now)
    head, tail = data.split("@@KEY@@")
    r = redis.Redis(host="127.0.0.1", port=port)
    t0 = time.perf_counter()
    try:
        r.sadd("sg:zones", ZONE)
        index = _zone_key(ZONE, "idx")
        batch = 5000
        for start in range(0, n, batch):
            pipe = r.pipeline(transaction=False)
            members: dict[str, float] = {}
            for i in range(start, min(n, start + batch)):
                k = key_of(i)
                pipe.hset(_record_key(ZONE, k), mapping={"v": str(rec.version), "s": rec.state.value,
                                                         "d": head + k + tail})  # fmt: skip
                members[k] = rec.updated_at
            pipe.zadd(index, members)
            pipe.execute()
    finally:
        r.close()
    return time.perf_counter() - t0


# --- timing through the real store -----------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def time_ops(stores: dict[int, Any], ops: int, seed: int) -> dict[int, dict[str, dict[str, float]]]:
    """Time each operation on every store (one per key count), interleaved call by call so
    that a stall of this shared machine hits every size alike."""
    rng = random.Random(seed)
    sizes = sorted(stores)
    lat: dict[int, dict[str, list[float]]] = {n: {"get": [], "reserve": [], "dup": []} for n in sizes}
    run = f"{time.time():.0f}"
    # A few untimed calls first: connections, statement caches, script loading.
    for n, store in stores.items():
        for _ in range(20):
            await store.get(ZONE, key_of(rng.randrange(n)))
        now = time.time()
        rec = new_record(f"warm:{run}", now, 0)
        await store.reserve(rec, None, cap_check(ZONE, CAPS, rec.sg_id, now), False)

    async def get(store: Any, n: int, i: int) -> None:
        rec = await store.get(ZONE, key_of(rng.randrange(n)))
        assert rec is not None

    async def reserve(store: Any, n: int, i: int) -> None:
        t = time.time()
        rec = new_record(f"new:{run}:{i}", t, i)
        res = await store.reserve(rec, None, cap_check(ZONE, CAPS, rec.sg_id, t), False)
        assert type(res).__name__ == "Reserved", res

    async def dup(store: Any, n: int, i: int) -> None:
        t = time.time()
        rec = new_record(key_of(rng.randrange(n)), t, i)
        res = await store.reserve(rec, None, cap_check(ZONE, CAPS, rec.sg_id, t), False)
        assert type(res).__name__ == "Conflict", res

    for name, fn in (("get", get), ("reserve", reserve), ("dup", dup)):
        deadline = time.monotonic() + 180
        for i in range(ops):
            if time.monotonic() > deadline:
                break
            order = sizes if i % 2 == 0 else list(reversed(sizes))
            for n in order:
                t0 = time.perf_counter()
                await fn(stores[n], n, i)
                lat[n][name].append((time.perf_counter() - t0) * 1000)
    return {
        n: {
            op: {
                "n": len(xs),
                "p50_ms": round(pct(xs, 50), 3),
                "p99_ms": round(pct(xs, 99), 3),
                "max_ms": round(max(xs), 3),
            }
            for op, xs in per.items()
        }
        for n, per in lat.items()
    }


def run_sqlite(tmp: Path, sizes: list[int], ops: int) -> list[dict[str, Any]]:
    from smtpguard.store.sqlite import SQLiteStore

    paths = {n: tmp / f"ledger-{n}.db" for n in sizes}

    async def init() -> None:
        for path in paths.values():
            s = SQLiteStore(f"sqlite:///{path}")
            await s.open()
            await s.close()

    asyncio.run(init())
    fills, nbytes = {}, {}
    for n, path in paths.items():
        fills[n] = fill_sqlite(path, n, time.time() - 86400)
        nbytes[n] = path.stat().st_size
        print(f"sqlite: filled {n:,} records in {fills[n]:.1f}s, {nbytes[n] / 1e6:.1f} MB", flush=True)

    try:
        timings = measure_stores({n: SQLiteStore(f"sqlite:///{p}") for n, p in paths.items()}, ops)
    finally:
        for path in paths.values():
            for suffix in ("", "-wal", "-shm"):
                Path(str(path) + suffix).unlink(missing_ok=True)
    note = "file size after wal_checkpoint(TRUNCATE); WAL, synchronous=FULL"
    return size_rows("sqlite", sizes, fills, nbytes, timings, note)


def run_redis(tmp: Path, sizes: list[int], ops: int) -> list[dict[str, Any]]:
    from smtpguard.store.redis import RedisStore

    servers: dict[int, Redis] = {}
    try:
        fills, used = {}, {}
        for n in sizes:
            servers[n] = Redis(tmp)
            base = servers[n].used_memory()
            fills[n] = fill_redis(servers[n].port, n, time.time() - 86400)
            used[n] = servers[n].used_memory() - base
            print(f"redis: filled {n:,} records in {fills[n]:.1f}s, {used[n] / 1e6:.1f} MB", flush=True)

        timings = measure_stores({n: RedisStore(srv.url) for n, srv in servers.items()}, ops)
    finally:
        for srv in servers.values():
            srv.stop()
    return size_rows("redis", sizes, fills, used, timings, "INFO used_memory delta; appendonly no")


def measure_stores(stores: dict[int, Any], ops: int) -> dict[int, dict[str, dict[str, float]]]:
    """time_ops over stores opened for the measurement and closed after it."""

    async def measure() -> dict[int, dict[str, dict[str, float]]]:
        for st in stores.values():
            await st.open()
        try:
            return await time_ops(stores, ops, seed=1)
        finally:
            for st in stores.values():
                await st.close()

    return asyncio.run(measure())


def size_rows(
    store: str,
    sizes: list[int],
    fills: dict[int, float],
    nbytes: dict[int, int],
    timings: dict[int, dict[str, dict[str, float]]],
    note: str,
) -> list[dict[str, Any]]:
    return [
        {
            "store": store,
            "keys": n,
            "fill_s": round(fills[n], 2),
            "bytes": nbytes[n],
            "bytes_per_record": round(nbytes[n] / n, 1),
            "ops": timings[n],
            "note": note,
        }
        for n in sizes
    ]


# --- the hourly cap window ----------------------------------------------------------------
async def time_reserves(stores: dict[str, Any], ops: int) -> dict[str, dict[str, float]]:
    """reserve() of new keys on each store, interleaved call by call."""
    lat: dict[str, list[float]] = {label: [] for label in stores}
    run = f"{time.time():.0f}"
    deadline = time.monotonic() + 180
    for i in range(ops):
        if time.monotonic() > deadline:
            break
        for label, store in stores.items():
            t = time.time()
            rec = new_record(f"win:{run}:{label}:{i}", t, i)
            t0 = time.perf_counter()
            res = await store.reserve(rec, None, cap_check(ZONE, CAPS, rec.sg_id, t), False)
            lat[label].append((time.perf_counter() - t0) * 1000)
            assert type(res).__name__ == "Reserved", res
    return {
        label: {"n": len(xs), "p50_ms": round(pct(xs, 50), 3), "p99_ms": round(pct(xs, 99), 3)}
        for label, xs in lat.items()
    }


def fill_sends_sqlite(path: Path, n: int, now: float) -> None:
    from smtpguard.policy.limits import month_of

    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT OR IGNORE INTO sends (zone, token, at, month) VALUES (?, ?, ?, ?)",
            ((ZONE, f"t{i:09d}", now - 3000 * i / n, month_of(now)) for i in range(n)),
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def fill_sends_redis(port: int, n: int, now: float) -> None:
    import redis

    from smtpguard.store.redis import _zone_key

    r = redis.Redis(host="127.0.0.1", port=port)
    try:
        for start in range(0, n, 10_000):
            r.zadd(
                _zone_key(ZONE, "sends"),
                {f"t{i:09d}": now - 3000 * i / n for i in range(start, min(n, start + 10_000))},
            )
    finally:
        r.close()


def run_window(tmp: Path, store: str, sends: int, ops: int) -> dict[str, Any]:
    """reserve() with an empty hourly window vs with `sends` sends in the last hour (a zone
    whose hourly cap is set high), both over 1,000 keys."""
    labels = {"empty": 0, f"{sends}": sends}
    now = time.time()
    servers: list[Redis] = []
    try:
        if store == "sqlite":
            from smtpguard.store.sqlite import SQLiteStore

            paths = {label: tmp / f"window-{label}.db" for label in labels}

            async def init() -> None:
                for path in paths.values():
                    st = SQLiteStore(f"sqlite:///{path}")
                    await st.open()
                    await st.close()

            asyncio.run(init())
            for label, path in paths.items():
                fill_sqlite(path, 1000, now - 86400)
                if labels[label]:
                    fill_sends_sqlite(path, labels[label], now)
            urls = {label: f"sqlite:///{p}" for label, p in paths.items()}
            factory: Any = SQLiteStore
        else:
            from smtpguard.store.redis import RedisStore

            urls = {}
            for label, n in labels.items():
                srv = Redis(tmp)
                servers.append(srv)
                fill_redis(srv.port, 1000, now - 86400)
                if n:
                    fill_sends_redis(srv.port, n, now)
                urls[label] = srv.url
            factory = RedisStore

        async def measure() -> dict[str, dict[str, float]]:
            stores = {label: factory(url) for label, url in urls.items()}
            for st in stores.values():
                await st.open()
            try:
                return await time_reserves(stores, ops)
            finally:
                for st in stores.values():
                    await st.close()

        return {"store": store, "sends_in_window": sends, "reserve": asyncio.run(measure())}
    finally:
        for srv in servers:
            srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ledger", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000, help="the large size (the small one is 1,000)")
    ap.add_argument("--small", type=int, default=1_000)
    ap.add_argument("--ops", type=int, default=1000, help="timed calls per operation")
    ap.add_argument("--stores", default="sqlite,redis")
    ap.add_argument(
        "--window-sends",
        type=int,
        default=0,
        help="also time reserve() with this many sends in the zone's hourly window (0: skip)",
    )
    ap.add_argument("--skip-keys", action="store_true", help="only the --window-sends experiment")
    args = ap.parse_args(argv)
    install_sigterm()
    stores = [s for s in args.stores.split(",") if s]
    if "redis" in stores and not (ROOT / "smtpguard" / "store" / "redis.py").exists():
        print("skip redis: smtpguard/store/redis.py does not exist yet")
        stores.remove("redis")
    results: list[dict[str, Any]] = []
    windows: list[dict[str, Any]] = []
    with workdir("smtpguard-ledger-") as tmp:
        for store in stores if args.window_sends else []:
            w = run_window(tmp, store, args.window_sends, args.ops)
            windows.append(w)
            print(
                f"{store:<6} reserve, 1,000 keys, hourly window empty vs {args.window_sends:,} sends: "
                + "  vs  ".join(
                    f"p50 {v['p50_ms']:.3f} p99 {v['p99_ms']:.3f} ms" for v in w["reserve"].values()
                ),
                flush=True,
            )
        for store in [] if args.skip_keys else stores:
            t0 = time.monotonic()
            sizes = [args.small, args.keys]
            rs = run_sqlite(tmp, sizes, args.ops) if store == "sqlite" else run_redis(tmp, sizes, args.ops)
            for r in rs:
                r["elapsed_s"] = round(time.monotonic() - t0, 1)
                results.append(r)
                print(
                    f"{store:<6} {r['keys']:>9} keys: {r['bytes_per_record']:7.1f} B/record  "
                    + "  ".join(
                        f"{k} p50 {v['p50_ms']:.3f} p99 {v['p99_ms']:.3f} ms" for k, v in r["ops"].items()
                    ),
                    flush=True,
                )
    if not results:
        path = write_result("ledger", {"machine": machine_info(), "ops": args.ops, "windows": windows})
        print(f"wrote {path.relative_to(ROOT)}")
        return 0
    print()
    print(
        f"{'store':<6} {'keys':>9} {'op':<8} {'p50 ms':>8} {'p99 ms':>8} {'p99 / p99@small':>16} "
        f"{'B/record':>9}"
    )
    verdicts = []
    for r in results:
        small = next(x for x in results if x["store"] == r["store"] and x["keys"] == args.small)
        for op, v in r["ops"].items():
            ratio = v["p99_ms"] / small["ops"][op]["p99_ms"] if small["ops"][op]["p99_ms"] else float("nan")
            print(f"{r['store']:<6} {r['keys']:>9} {op:<8} {v['p50_ms']:>8.3f} {v['p99_ms']:>8.3f} "
                  f"{ratio:>16.2f} {r['bytes_per_record']:>9.1f}")  # fmt: skip
            if r["keys"] == args.keys:
                verdicts.append(
                    f"{r['store']} {op}: p99 at {args.keys:,} keys = {ratio:.2f}x p99 at {args.small:,} "
                    f"(target <= 2x) {'MET' if ratio <= 2 else 'NOT MET'}"
                )
    print("\nTargets (ran " + f"{args.small:,} vs {args.keys:,} keys, {args.ops} timed calls per op):")
    for v in verdicts:
        print("  " + v)
    path = write_result(
        "ledger",
        {"machine": machine_info(), "small": args.small, "keys": args.keys, "ops": args.ops,
         "results": results, "targets": verdicts, "windows": windows},
    )  # fmt: skip
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
