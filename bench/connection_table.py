"""The shared connection table (smtpguard/connection_table.py): how long one admit or release
holds the calling event loop, with other workers using the table at the same time.

    .venv/bin/python -m bench.connection_table                 # 3 workers, 3 s, then a stalled holder
    .venv/bin/python -m bench.connection_table --workers 4 --seconds 5

Two scenarios, each printing the time one admit+release pair took in the measured process
(the time its event loop could do nothing else), as p50 / p99 / p99.9 / max, and how many
admits found the table busy (answered on the worker's own counts instead):

- contention: every worker process admits and releases connections of 200 addresses as
  fast as it can, all on one table;
- stalled holder: one process takes the table's lock and keeps it for --stall ms (a worker
  stopped by SIGSTOP, or descheduled, while it held the lock); the others carry on.
"""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from smtpguard.connection_table import ConnectionTable, address_key

ADDRESSES = [address_key(f"10.1.{i // 250}.{i % 250}") for i in range(200)]


def _hammer(path: str, workers: int, index: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    table = ConnectionTable.attach(Path(path), workers)
    rng = random.Random(index)
    samples: list[int] = []
    busy = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        key = rng.choice(ADDRESSES)
        t0 = time.perf_counter_ns()
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


def _hold(path: str, stall: float, started: mp.Event) -> None:  # type: ignore[type-arg]
    # The whole file, as the table locks it: the stance of a worker stopped inside admit().
    fd = os.open(path, os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    started.set()
    time.sleep(stall)
    fcntl.lockf(fd, fcntl.LOCK_UN)
    os.close(fd)


def _report(name: str, runs: list[tuple[list[int], int]]) -> None:
    samples = sorted(s for run, _ in runs for s in run)
    q = statistics.quantiles(samples, n=1000)
    us = 1000.0
    print(
        f"{name:<16} pairs {len(samples):>8}  p50 {q[499] / us:8.1f} µs  p99 {q[989] / us:8.1f} µs  "
        f"p99.9 {q[998] / us:9.1f} µs  max {samples[-1] / us:10.1f} µs  "
        f"busy {sum(r for _, r in runs)}"
    )


def run(workers: int, seconds: float, stall: float) -> None:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-connections-") as tmp:
        path = str(Path(tmp) / "connections")
        ConnectionTable.sized_for(Path(path), workers, 1000, create=True).close()
        out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        procs = [ctx.Process(target=_hammer, args=(path, workers, i, seconds, out)) for i in range(workers)]
        for p in procs:
            p.start()
        runs = [out.get() for _ in procs]
        for p in procs:
            p.join()
        _report("contention", runs)

        started = ctx.Event()
        holder = ctx.Process(target=_hold, args=(path, stall, started))
        holder.start()
        started.wait(10)
        procs = [
            ctx.Process(target=_hammer, args=(path, workers, i, stall * 2, out)) for i in range(workers - 1)
        ]
        for p in procs:
            p.start()
        runs = [out.get() for _ in procs]
        for p in [*procs, holder]:
            p.join()
        _report(f"stalled {stall * 1000:.0f} ms", runs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--stall", type=float, default=200.0, help="ms the stalled holder keeps the lock")
    args = parser.parse_args()
    print(f"{args.workers} worker processes on {os.cpu_count()} cores")
    run(args.workers, args.seconds, args.stall / 1000)


if __name__ == "__main__":
    main()
