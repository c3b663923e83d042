"""What upstream PIPELINING (RFC 2920) would save smtpguard's relay, measured on loopback.

    .venv/bin/python -m bench.pipelining            # 3 s per row
    .venv/bin/python -m bench.pipelining --quick    # 1 s per row

aiosmtplib sends MAIL, RCPT and DATA lock-step (one command, wait for its reply, the next):
four round trips per message with the content. A client that pipelines writes MAIL, RCPT
and DATA at once and reads the three replies, then the content: two round trips. This
bench sends the same messages to the same upstream sink (Postfix's smtp-sink, which offers
PIPELINING) three ways, one after the other in one process and one event loop:

  aiosmtplib   aiosmtplib.SMTP's mail()/rcpt()/data() on pooled connections, as smtpguard's
               relay does (its per-command CPU included)
  raw-lockstep raw asyncio streams, one command at a time (bench/client.py)
  raw-pipelined the same streams, MAIL+RCPT+DATA in one write (bench/client.py --pipelining)

at 1 connection (latency: round trips per message) and 8 (smtpguard's default upstream
pool_size). CPU per message is this process's user+system time over the window divided by
the messages (the sink's CPU is reported apart). The difference raw-lockstep - raw-pipelined
is what pipelining saves a relay on the wire; aiosmtplib - raw-lockstep is what aiosmtplib's
own layers cost per message.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiosmtplib

from bench.client import body_for, message_bytes, run_load
from bench.common import (
    RECIPIENT,
    ROOT,
    SENDER,
    Sink,
    cpu_seconds,
    install_sigterm,
    machine_info,
    stamp,
    workdir,
    write_result,
)


async def aiosmtplib_load(
    port: int, sessions: int, warmup: float, duration: float, size: int
) -> dict[str, Any]:
    """`sessions` aiosmtplib connections sending back to back, lock-step, as the relay does."""
    body = body_for(size)
    conns = [
        aiosmtplib.SMTP(hostname="127.0.0.1", port=port, local_hostname="bench.relay")
        for _ in range(sessions)
    ]
    for c in conns:
        await c.connect()
        await c.ehlo()
    latencies: list[float] = []
    measured = 0
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + duration
    cpu: dict[str, float] = {}

    async def loop(idx: int, c: aiosmtplib.SMTP) -> None:
        nonlocal measured
        seq = 0
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                return
            payload = message_bytes(f"pipe:{idx}:{seq}", body)[:-3]  # aiosmtplib adds the dot
            seq += 1
            await c.mail(SENDER)
            await c.rcpt(RECIPIENT)
            await c.data(payload)
            t1 = time.perf_counter()
            if t0 >= measure_from and t1 < end:
                measured += 1
                latencies.append((t1 - t0) * 1000)

    async def edges() -> None:
        await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
        t = os.times()
        cpu["start"] = t.user + t.system
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        t = os.times()
        cpu["end"] = t.user + t.system

    await asyncio.gather(edges(), *(loop(i, c) for i, c in enumerate(conns)))
    for c in conns:
        c.close()
    return {
        "measured": measured,
        "window": duration,
        "latencies": latencies,
        "client_cpu": cpu["end"] - cpu["start"],
    }


async def raw_load(
    port: int, sessions: int, warmup: float, duration: float, size: int, pipelining: bool
) -> dict[str, Any]:
    cpu: dict[str, float] = {}

    def on_window(edge: str) -> None:
        t = os.times()
        cpu[edge] = t.user + t.system

    res = await run_load(
        port, sessions, auth=False, key_prefix=f"pipe:{pipelining}:{time.time()}", warmup=warmup,
        duration=duration, max_messages=10**7, size=size, pipelining=pipelining, on_window=on_window,
    )  # fmt: skip
    if res.errors:
        raise RuntimeError(f"errors from the sink: {dict(res.errors)}")
    return {
        "measured": res.measured,
        "window": res.window,
        "latencies": res.latencies_ms,
        "client_cpu": cpu["end"] - cpu["start"],
    }


def run_row(
    name: str, sessions: int, sink: Sink, fn: Callable[[], Coroutine[Any, Any, dict[str, Any]]], loop: str
) -> dict[str, Any]:
    before = cpu_seconds(sink.proc.pid)
    if loop == "uvloop":
        import uvloop

        got = uvloop.run(fn())
    else:
        got = asyncio.run(fn())
    sink_cpu = cpu_seconds(sink.proc.pid) - before
    n = got["measured"]
    lat = sorted(got["latencies"])
    return {
        "client": name,
        "sessions": sessions,
        "msgs_s": round(n / got["window"], 1) if got["window"] else 0.0,
        "p50_ms": round(statistics.median(lat), 3) if lat else None,
        "p99_ms": round(lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 3) if lat else None,
        "client_cpu_us_per_msg": round(1e6 * got["client_cpu"] / n, 1) if n else None,
        # Over warm-up and window both: an upper bound, for the shape only.
        "sink_cpu_us_per_msg_upper": round(1e6 * sink_cpu / n, 1) if n else None,
        "messages": n,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pipelining", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 s per row")
    ap.add_argument("--duration", type=float)
    ap.add_argument("--sessions", default="1,8")
    ap.add_argument("--size", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the table shows each row's median round")
    ap.add_argument(
        "--loop", choices=["uvloop", "asyncio"], default=None, help="default: uvloop if installed"
    )
    args = ap.parse_args(argv)
    install_sigterm()
    loop = args.loop
    if loop is None:
        try:
            import uvloop  # noqa: F401

            loop = "uvloop"
        except ImportError:
            loop = "asyncio"
    duration = args.duration or (1.0 if args.quick else 3.0)
    warmup = 0.3
    sessions = [int(x) for x in args.sessions.split(",") if x]
    rows: list[dict[str, Any]] = []
    with workdir("smtpguard-bench-pipe-") as tmp:
        sink = Sink(tmp)
        if sink.kind != "smtp-sink":
            print("note: bench/sink.py stands in for smtp-sink (it may not offer PIPELINING)")
        try:
            for rnd in range(args.repeat):
                for n in sessions:
                    variants: list[tuple[str, Callable[[], Coroutine[Any, Any, dict[str, Any]]]]] = [
                        (
                            "aiosmtplib",
                            lambda n=n: aiosmtplib_load(sink.port, n, warmup, duration, args.size),
                        ),
                        (
                            "raw-lockstep",
                            lambda n=n: raw_load(sink.port, n, warmup, duration, args.size, False),
                        ),
                        (
                            "raw-pipelined",
                            lambda n=n: raw_load(sink.port, n, warmup, duration, args.size, True),
                        ),
                    ]
                    for name, fn in variants:
                        row = run_row(name, n, sink, fn, loop)
                        row["round"] = rnd
                        rows.append(row)
                        print(
                            f"round {rnd + 1} {name:<14} {n:>2} conns: {row['msgs_s']:8.0f} msgs/s  p50 "
                            f"{row['p50_ms']} ms  client CPU {row['client_cpu_us_per_msg']} us/msg",
                            flush=True,
                        )
        finally:
            sink.stop()
    table = median_rows(rows)
    print()
    print(
        f"{'client':<14} {'conns':>5} {'msgs/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/msg':>10}  "
        "sink CPU us/msg (upper)"
    )
    for r in table:
        print(
            f"{r['client']:<14} {r['sessions']:>5} {r['msgs_s']:>8.0f} {r['p50_ms']:>8} {r['p99_ms']:>8} "
            f"{r['client_cpu_us_per_msg']:>10}  {r['sink_cpu_us_per_msg_upper']}"
        )
    savings = pipelining_savings(table)
    print()
    for line in savings:
        print(line)
    path = write_result(
        "pipelining",
        {"machine": machine_info(), "loop": loop, "duration": duration, "rows": rows, "table": table,
         "savings": savings, "stamp": stamp()},
    )  # fmt: skip
    print(f"\nwrote {path.relative_to(ROOT)}")
    return 0


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (client, sessions): the round with the median CPU per message."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["client"], r["sessions"]), []).append(r)
    out = []
    for group in groups.values():
        ranked = sorted(group, key=lambda r: r["client_cpu_us_per_msg"] or 0.0)
        out.append(ranked[(len(ranked) - 1) // 2])
    return out


def pipelining_savings(table: list[dict[str, Any]]) -> list[str]:
    index = {(r["client"], r["sessions"]): r for r in table}
    out = []
    for n in sorted({r["sessions"] for r in table}):
        lock, pipe, lib = (index.get((c, n)) for c in ("raw-lockstep", "raw-pipelined", "aiosmtplib"))
        if not (lock and pipe):
            continue
        cpu = (lock["client_cpu_us_per_msg"] or 0) - (pipe["client_cpu_us_per_msg"] or 0)
        lat = (lock["p50_ms"] or 0) - (pipe["p50_ms"] or 0)
        line = (
            f"{n} conns: pipelining saves {cpu:.0f} us of client CPU per message and {lat:.3f} ms of p50 "
            f"latency ({lock['msgs_s']:.0f} -> {pipe['msgs_s']:.0f} msgs/s)"
        )
        if lib:
            line += f"; aiosmtplib lock-step costs {lib['client_cpu_us_per_msg']} us/msg"
        out.append(line)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
