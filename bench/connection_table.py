"""The shared connection table (smtpguard/connection_table.py): how long one admit or release
holds the calling event loop, with other workers using the table at the same time.

    .venv/bin/python -m bench.connection_table                 # 3 workers, 3 s, then a stopped holder
    .venv/bin/python -m bench.connection_table --workers 4 --seconds 5

Two scenarios, each run first with the lock waited for (as admit and release took it
before: fcntl.lockf blocking, in the event loop) and then as they take it now (tried
without waiting, for at most 2 ms), each printing the time one admit+release pair took
in the measured process (the time its event loop could do nothing else), as p50 / p99 /
p99.9 / max, and how many admits found the table busy (answered on the worker's own counts instead):

- contention: every worker process admits and releases connections of 200 addresses as
  fast as it can, all on one table;
- stopped holder: one process takes the table's lock and stops itself (SIGSTOP) for --stall
  ms, as a worker stopped while it held the lock; the others carry on meanwhile.
"""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing as mp
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from smtpguard.connection_table import ConnectionTable, address_key

ADDRESSES = [address_key(f"10.1.{i // 250}.{i % 250}") for i in range(200)]


def _blocking_admit(table: ConnectionTable, worker: int, key: bytes, total: int, per_ip: int) -> bool:
    """The lock as it was taken before: waited for, in the event loop."""
    fcntl.lockf(table._fd, fcntl.LOCK_EX)
    try:
        return table._admit(worker, key, total, per_ip)
    finally:
        fcntl.lockf(table._fd, fcntl.LOCK_UN)


def _blocking_release(table: ConnectionTable, worker: int, key: bytes) -> None:
    fcntl.lockf(table._fd, fcntl.LOCK_EX)
    try:
        table._release(worker, key)
    finally:
        fcntl.lockf(table._fd, fcntl.LOCK_UN)


def _hammer(
    path: str,
    workers: int,
    index: int,
    seconds: float,
    blocking: bool,
    go: Any,
    out: mp.Queue,  # type: ignore[type-arg]
) -> None:
    table = ConnectionTable.attach(Path(path), workers)
    rng = random.Random(index)
    samples: list[int] = []
    busy = 0
    go.wait()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        key = rng.choice(ADDRESSES)
        t0 = time.perf_counter_ns()
        if blocking:
            if _blocking_admit(table, index, key, 10_000, 1_000):
                _blocking_release(table, index, key)
        else:
            got = table.admit(index, key, 10_000, 1_000)
            if got:
                table.release(index, key)
            busy += got is None
        samples.append(time.perf_counter_ns() - t0)
    # What a worker's loop does with the releases a busy table kept: try until they apply.
    while not table.flush():
        time.sleep(0.001)
    table.close()
    out.put((samples, busy))


def _hold(path: str, go: Any) -> None:
    # The whole file, as the table locks it, then stopped: a worker SIGSTOPped inside admit().
    fd = os.open(path, os.O_RDWR)
    go.wait()
    fcntl.lockf(fd, fcntl.LOCK_EX)
    os.kill(os.getpid(), signal.SIGSTOP)
    fcntl.lockf(fd, fcntl.LOCK_UN)
    os.close(fd)


def _report(name: str, runs: list[tuple[list[int], int]]) -> None:
    samples = sorted(s for run, _ in runs for s in run)
    q = statistics.quantiles(samples, n=1000)
    us = 1000.0
    print(
        f"{name:<38} pairs {len(samples):>8}  p50 {q[499] / us:8.1f} µs  p99 {q[989] / us:8.1f} µs  "
        f"p99.9 {q[998] / us:9.1f} µs  max {samples[-1] / us:10.1f} µs  "
        f"busy {sum(r for _, r in runs)}"
    )


def _scenario(ctx: Any, path: str, workers: int, seconds: float, stall: float, blocking: bool) -> None:
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    n = workers - 1 if stall else workers
    go = ctx.Barrier(n + (2 if stall else 1))
    procs = [
        ctx.Process(target=_hammer, args=(path, workers, i, seconds, blocking, go, out)) for i in range(n)
    ]
    holder = ctx.Process(target=_hold, args=(path, go)) if stall else None
    for p in [*procs, *([holder] if holder else [])]:
        p.start()
    go.wait()  # every process started: all begin together
    if holder is not None:
        time.sleep(stall)
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGCONT)
    runs = [out.get() for _ in procs]
    for p in [*procs, *([holder] if holder else [])]:
        p.join()
    name = f"holder stopped {stall * 1000:.0f} ms" if stall else "contention"
    _report(f"{name}, {'blocking (before)' if blocking else 'try-lock (now)'}", runs)


def run(workers: int, seconds: float, stall: float) -> None:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-connections-") as tmp:
        path = str(Path(tmp) / "connections")
        ConnectionTable.sized_for(Path(path), workers, 1000, create=True).close()
        for blocking in (True, False):
            _scenario(ctx, path, workers, seconds, 0.0, blocking)
        for blocking in (True, False):
            _scenario(ctx, path, workers, stall * 2, stall, blocking)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--stall", type=float, default=200.0, help="ms the stopped holder keeps the lock")
    args = parser.parse_args()
    print(f"{args.workers} worker processes on {os.cpu_count()} cores")
    run(args.workers, args.seconds, args.stall / 1000)


if __name__ == "__main__":
    main()
