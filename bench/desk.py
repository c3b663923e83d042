"""The operator's lookups at 10k and at 1M records, both stores, in one run (DESIGN.md §14).

    .venv/bin/python -m bench.desk                 # 10k and 1M records
    .venv/bin/python -m bench.desk --sizes 10000,100000

Each store is filled with N records of one zone through the store's own write path (the
SQLite writer's statements; the Redis put script, pipelined), 1% of them `unknown`, the
rest `delivered`. Then, 200 times each: `list` of the held records (state unknown, 100
newest), `list` of the newest 100 of any state, a page further back (`before`), and the
lookups by smtpguard id, Message-ID and upstream id. Printed: p50 and p99 per query and
size, and the p99 ratio of the largest size to the smallest (the target: within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import Redis, workdir
from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, Record, State, Submission
from smtpguard.store import Store, store_from_url

ZONE = "bench"
T0 = 1_790_000_000.0


def record(i: int) -> Record:
    sub = Submission(ZONE, f"k{i:08}", f"fp{i}", f"sg{i:010}", "bench", f"<m{i}@bench.example>")
    verdict = ledger.decide(None, sub, T0 + i, LedgerSettings())
    assert isinstance(verdict, ledger.Proceed)
    state = State.UNKNOWN if i % 100 == 0 else State.DELIVERED
    return replace(verdict.record, state=state, version=2, updated_at=T0 + i, upstream_id=f"Q{i}", owner=None)


def fill_sqlite(path: Path, n: int) -> None:
    from smtpguard.store.sqlite import _save

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = OFF")  # filling only; the store reopens it with FULL
    for start in range(0, n, 20_000):
        conn.execute("BEGIN")
        for i in range(start, min(n, start + 20_000)):
            _save(conn, record(i))
        conn.execute("COMMIT")
    conn.close()


async def fill_redis(store: Store, n: int) -> None:
    from smtpguard.store.redis import RedisStore, _dump, _ids, _record_key, _zone_key

    assert isinstance(store, RedisStore)
    script = store._put
    assert script is not None
    await store.put(record(0), None)  # loads the script
    client = store._r
    for start in range(1, n, 2_000):
        async with client.pipeline(transaction=False) as pipe:
            for i in range(start, min(n, start + 2_000)):
                r = record(i)
                keys = [_record_key(ZONE, r.key), _zone_key(ZONE, "idx")]
                args = ["", str(r.version), r.state.value, _dump(r), r.updated_at, r.key, *_ids(r)]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            await pipe.execute()
    await client.sadd("sg:zones", ZONE)


async def timed(fn: Callable[[], Awaitable[Any]], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


async def measure(store: Store, n: int, rounds: int) -> dict[str, list[float]]:
    rng = random.Random(n)
    picks = [rng.randrange(n) for _ in range(rounds)]
    it = iter(picks * 4)
    queries: dict[str, Callable[[], Awaitable[Any]]] = {
        "list held (unknown, 100)": lambda: store.list_records(ZONE, "unknown", None, None, 100),
        "list newest (100)": lambda: store.list_records(ZONE, None, None, None, 100),
        "list a page back (100)": lambda: store.list_records(ZONE, "delivered", None, T0 + n / 2, 100),
        "history --id": lambda: store.find_records("sg_id", f"sg{next(it):010}"),
        "history --message-id": lambda: store.find_records("message_id", f"<m{next(it)}@bench.example>"),
        "history --upstream-id": lambda: store.find_records("upstream_id", f"Q{next(it)}"),
        "state counts": lambda: store.state_counts(ZONE),
    }
    out = {}
    for name, q in queries.items():
        found = await q()
        assert found, (name, n)
        out[name] = await timed(q, rounds if name != "state counts" else max(10, rounds // 20))
    return out


def p(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) >= 2 else xs[0]


async def run(sizes: list[int], rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with workdir("sg-bench-desk-") as tmp:
        for kind in ("sqlite", "redis"):
            for n in sizes:
                t = time.perf_counter()
                redis = None
                if kind == "sqlite":
                    db = tmp / f"desk-{n}.db"
                    store = store_from_url(f"sqlite:///{db}")
                    await store.open()  # the schema
                    await store.close()
                    await asyncio.to_thread(fill_sqlite, db, n)
                    store = store_from_url(f"sqlite:///{db}")
                    await store.open()
                else:
                    (tmp / f"r{n}").mkdir()
                    redis = Redis(tmp / f"r{n}")
                    store = store_from_url(redis.url)
                    await store.open()
                    await fill_redis(store, n)
                filled = time.perf_counter() - t
                try:
                    results[f"{kind} {n}"] = {"filled_s": filled, **await measure(store, n, rounds)}
                finally:
                    await store.close()
                    if redis is not None:
                        redis.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,1000000")
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    results = asyncio.run(run(sizes, args.rounds))
    small, large = min(sizes), max(sizes)
    queries = [k for k in next(iter(results.values())) if k != "filled_s"]
    print(
        f"{'store':7} {'query':26} "
        + " ".join(f"{'p50/p99 ms @' + str(n):>22}" for n in sizes)
        + "  p99 ratio"
    )
    for kind in ("sqlite", "redis"):
        for q in queries:
            cells = []
            for n in sizes:
                xs = results[f"{kind} {n}"][q]
                cells.append(f"{p(xs, 50):>10.2f}/{p(xs, 99):<10.2f}")
            ratio = p(results[f"{kind} {large}"][q], 99) / p(results[f"{kind} {small}"][q], 99)
            print(f"{kind:7} {q:26} " + " ".join(f"{c:>22}" for c in cells) + f"  {ratio:9.2f}")
    print(json.dumps({k: {"filled_s": round(v["filled_s"], 1)} for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
