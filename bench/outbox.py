"""The outbox (DESIGN.md §20): how fast `serve` drains a backlog of committed rows, beside
SMTP submission of the same messages in the same run, and the latency from an application's
COMMIT to the row's receipt (written right after the upstream's 250).

    .venv/bin/python -m bench.outbox                 # 10,000-row backlog, 2,000 SMTP messages
    .venv/bin/python -m bench.outbox --rows 1000 --smtp 1000 --latency 100

Everything real: a private PostgreSQL (the application's database, fsync on), `smtpguard
serve` as a child process on a SQLite store, Postfix's smtp-sink (or bench/sink.py) as the
provider. The backlog is committed in one transaction while serve runs, so the drain rate
is rows / (last receipt - COMMIT). SMTP runs `--sessions` sessions (the reader submits up to
that many rows at once too). Latency: `--latency` rows, one transaction each, paced at
`--rate` per second, each row's done_at minus its COMMIT time (same machine, same clock).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.client import body_for, deliver_keys, message_bytes
from bench.common import (
    RECIPIENT,
    SENDER,
    USER,
    ZONE,
    Guard,
    Postgres,
    Sink,
    cpu_seconds,
    free_port,
    guard_config,
    machine_info,
    start_store,
    workdir,
    write_result,
)
from smtpguard.outbox.reader import CONCURRENCY
from smtpguard.outbox.schema import ddl

_INSERT = "INSERT INTO smtpguard_outbox (event_key, message, mail_from, rcpt_to) VALUES (%s, %s, %s, %s)"


def _row(key: str, body: bytes) -> tuple[str, bytes, str, list[str]]:
    # The SMTP bench's very message, without the DATA terminator.
    return key, message_bytes(key, body)[: -len(b".\r\n")], SENDER, [RECIPIENT]


def _done(url: str, prefix: str) -> tuple[int, float | None]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE state = 'sent'), extract(epoch FROM max(done_at)) "
            "FROM smtpguard_outbox WHERE event_key LIKE %s",
            [prefix + "%"],
        ).fetchone()
    assert row is not None
    return int(row[0]), None if row[1] is None else float(row[1])


def _wait_sent(url: str, prefix: str, n: int, timeout: float) -> tuple[int, float | None]:
    deadline = time.monotonic() + timeout
    while True:
        sent, last = _done(url, prefix)
        if sent >= n or time.monotonic() > deadline:
            return sent, last
        time.sleep(0.05)


def backlog(url: str, rows: int, size: int, timeout: float, cpu_root: int | None = None) -> dict[str, Any]:
    """`cpu_root`: also the CPU of that process tree (smtpguard) per row sent, from just
    before the COMMIT to the last receipt seen."""
    body = body_for(size)
    with psycopg.connect(url) as conn:
        with conn.cursor() as cur:
            cur.executemany(_INSERT, [_row(f"ob:{i}", body) for i in range(rows)])
        cpu0 = cpu_seconds(cpu_root) if cpu_root is not None else 0.0
        conn.commit()
        committed = time.time()
    sent, last = _wait_sent(url, "ob:", rows, timeout)
    cpu1 = cpu_seconds(cpu_root) if cpu_root is not None else 0.0
    seconds = (last or time.time()) - committed
    out: dict[str, Any] = {
        "rows": rows,
        "sent": sent,
        "seconds": round(seconds, 2),
        "msgs_per_s": round(sent / seconds, 1),
    }
    if cpu_root is not None:
        out["cpu_ms_per_msg"] = round(1000 * (cpu1 - cpu0) / sent, 3) if sent else None
    return out


def outbox_guard(
    tmp: Path, name: str, sink: Sink, store_url: str, app_url: str, pool_size: int, batch: int
) -> Guard:
    """`serve` (one process: no `workers` key) reading the outbox table at `app_url`."""
    cfg = guard_config(free_port(), sink.port, store_url, pool_size)
    cfg["outbox"] = {"app": {"url": app_url, "zone": ZONE, "user": USER, "batch": batch}}
    return Guard(tmp, name, cfg)


def create_table(app_url: str) -> None:
    with psycopg.connect(app_url, autocommit=True) as conn:
        conn.execute(ddl())  # type: ignore[arg-type]


def drain_row(
    tmp: Path, sink: Sink, store: str, rows: int, size: int, pool_size: int, batch: int, timeout: float
) -> dict[str, Any]:
    """bench.cores' outbox row: a `rows` backlog drained by one smtpguard process on `store`
    (sqlite, redis or postgres), its own PostgreSQL as the application's database (the
    postgres store in a second database of it), every server stopped before returning.
    Adds `sink_received`: what the sink counted over the drain (must equal `sent`)."""
    stop: list[Any] = []
    try:
        pg = Postgres(tmp)
        stop.append(pg)
        create_table(pg.url)
        store_url = start_store(store, tmp, "ledger", stop, pg)
        before = sink.settled_count(quiet=0.2)
        guard = outbox_guard(tmp, f"outbox-{store}", sink, store_url, pg.url, pool_size, batch)
        stop.append(guard)
        out = backlog(pg.url, rows, size, timeout, cpu_root=guard.pid)
        out["sink_received"] = sink.settled_count(quiet=0.3) - before
        return out
    finally:
        for s in reversed(stop):
            with contextlib.suppress(Exception):
                s.stop()


def smtp(port: int, n: int, sessions: int, size: int) -> dict[str, Any]:
    started = time.perf_counter()
    res = asyncio.run(deliver_keys(port, [f"smtp:{i}" for i in range(n)], sessions, auth=True, size=size))
    seconds = time.perf_counter() - started
    return {
        "messages": n,
        "accepted": res.new_accepted,
        "errors": dict(res.errors),
        "seconds": round(seconds, 2),
        "msgs_per_s": round(res.new_accepted / seconds, 1),
    }


def latency(url: str, n: int, rate: float, size: int, timeout: float) -> dict[str, Any]:
    body = body_for(size)
    committed: dict[str, float] = {}
    with psycopg.connect(url) as conn:
        for i in range(n):
            key = f"lat:{i}"
            conn.execute(_INSERT, _row(key, body))
            conn.commit()
            committed[key] = time.time()
            time.sleep(1 / rate)
    _wait_sent(url, "lat:", n, timeout)
    with psycopg.connect(url) as conn:
        done = dict(
            conn.execute(  # type: ignore[arg-type]
                "SELECT event_key, extract(epoch FROM done_at) FROM smtpguard_outbox "
                "WHERE event_key LIKE 'lat:%' AND done_at IS NOT NULL"
            ).fetchall()
        )
    ms = sorted((float(done[k]) - t) * 1000 for k, t in committed.items() if k in done)

    def pct(p: float) -> float:
        return round(ms[min(len(ms) - 1, round(p / 100 * (len(ms) - 1)))], 1) if ms else float("nan")

    return {
        "rows": n,
        "done": len(ms),
        "rate": rate,
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": pct(100),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with workdir("smtpguard-bench-outbox-") as tmp:
        pg = Postgres(tmp)
        sink = Sink(tmp)
        guard: Guard | None = None
        try:
            create_table(pg.url)
            guard = outbox_guard(
                tmp, "guard", sink, f"sqlite:///{Path(tmp) / 'state.db'}", pg.url, args.pool_size, args.batch
            )
            out = {
                "machine": machine_info(),
                "sink": sink.kind,
                "size": args.size,
                "sessions": args.sessions,
                "reader_concurrency": CONCURRENCY,
                "batch": args.batch,
                "outbox": backlog(pg.url, args.rows, args.size, args.timeout),
                "smtp": smtp(guard.port, args.smtp, args.sessions, args.size),
                "latency": latency(pg.url, args.latency, args.rate, args.size, args.timeout),
            }
        finally:
            if guard is not None:
                guard.stop()
            sink.stop()
            pg.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000, help="outbox backlog (default 10,000)")
    parser.add_argument("--smtp", type=int, default=2_000, help="SMTP messages for the comparison")
    parser.add_argument("--sessions", type=int, default=CONCURRENCY, help="SMTP sessions")
    parser.add_argument("--size", type=int, default=2000, help="message body bytes")
    parser.add_argument("--batch", type=int, default=100, help="outbox.batch")
    parser.add_argument("--pool-size", type=int, default=8, help="upstream pool size")
    parser.add_argument("--latency", type=int, default=200, help="rows for COMMIT → receipt latency")
    parser.add_argument("--rate", type=float, default=20.0, help="latency rows per second")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on each drain")
    args = parser.parse_args()
    out = run(args)
    o, s, lat = out["outbox"], out["smtp"], out["latency"]
    print(f"{'scenario':<34}{'messages':>10}{'seconds':>10}{'msgs/s':>10}")
    print(f"{'outbox backlog drain':<34}{o['sent']:>10}{o['seconds']:>10}{o['msgs_per_s']:>10}")
    print(
        f"{f'SMTP, {args.sessions} sessions':<34}{s['accepted']:>10}{s['seconds']:>10}{s['msgs_per_s']:>10}"
    )
    print(
        f"COMMIT → receipt ({lat['done']} rows at {lat['rate']:g}/s): "
        f"p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms, max {lat['max_ms']} ms"
    )
    print(f"results: {write_result('outbox', out)}")


if __name__ == "__main__":
    main()
