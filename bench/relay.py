"""Relay throughput and latency: the same load through each scenario, in one run.

    .venv/bin/python -m bench.relay            # full run (3 s per measurement)
    .venv/bin/python -m bench.relay --quick    # short run (1 s per measurement)
    .venv/bin/python -m bench.relay --profile  # then py-spy smtpguard+SQLite at 50 sessions

Scenarios, all in front of the same upstream sink (Postfix's smtp-sink when installed):
  direct        the client straight to the sink (the limit of this machine and this client)
  null          a bare aiosmtpd listener answering 250, relaying nothing (bench/servers.py)
  naive         aiosmtpd + aiosmtplib pass-through with pooled upstream connections
  guard-sqlite  `python -m smtpguard serve`, SQLite store
  guard-sqlite-asyncio  the same on asyncio's own event loop (event_loop: asyncio), as
                smtpguard runs without the `fast` extra (uvloop)
  guard-redis   the same with a private redis-server (appendonly no, no snapshots)
  guard-postgres  the same with a private PostgreSQL (fsync and synchronous_commit on)
  guard-sqlite-queue, guard-redis-queue, guard-postgres-queue
                the same three with the zone in store-and-forward mode (`delivery: queue`):
                the client's latency is the `250 queued as ID`; the sink's counters give the
                sustained delivery rate (delivered/s), measured until everything accepted has
                reached the sink (bounded wait). `unique` and `paced` modes only.
  postfix       a private Postfix relay (relayhost = the sink); clients send WITHOUT AUTH
                from 127.0.0.1 (mynetworks), since Postfix's smtpd has no SASL set up here

Modes: `unique` (every message a new X-Event-Key), `dup` (duplicate storm: 90% of the
submissions repeat keys delivered before the measurement), `paced` (10 sessions at a fixed
total rate, so latency shows service time rather than queueing).

Every proxy (and redis-server) is started fresh for each row and stopped by PID afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import bench.common as bench_common
from bench.client import LoadResult, deliver_keys, run_load
from bench.common import (
    PY,
    RESULTS,
    ROOT,
    Guard,
    Postfix,
    Postgres,
    Proc,
    Redis,
    Sink,
    cpu_seconds,
    free_port,
    guard_config,
    install_sigterm,
    machine_info,
    memory_mb,
    password_hash,
    pss_mb,
    stamp,
    wait_port,
    workdir,
    write_result,
)

ALL_SCENARIOS = [
    "direct", "null", "naive", "guard-sqlite", "guard-sqlite-asyncio", "guard-sqlite-queue", "guard-redis",
    "guard-redis-queue", "guard-postgres", "guard-postgres-queue", "postfix",
]  # fmt: skip
BASELINES = ["direct", "null", "naive"]
QUEUE_SCENARIOS = {
    "guard-sqlite-queue": "guard-sqlite",
    "guard-redis-queue": "guard-redis",
    "guard-postgres-queue": "guard-postgres",
}
"""queue scenario -> the relay scenario with the same store (its msgs/s is the delivery target)."""
BASE_SUFFIX = "@base"
"""`guard-…@base`: the same scenario run from an export of `--baseline REV` (before/after)."""
BASE_SRC: Path | None = None
QUEUE_MODES = ("unique", "paced")
"""`paced` (10 sessions, 50 msgs/s) shows the acceptance service time without queueing."""
QUEUE_P99_TARGET_MS = 10.0


@dataclass
class Row:
    scenario: str
    mode: str
    sessions: int
    msgs_s: float = 0.0
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    rss_mb: float | None = None
    hwm_mb: float | None = None
    proxy_cpu_ms_per_msg: float | None = None
    """CPU (user+system) of the proxy's processes per measured message (redis-server excluded)."""
    client_cpu_ms_per_msg: float | None = None
    measured: int = 0
    window_s: float = 0.0
    sent: int = 0
    ok: int = 0
    duplicates_answered: int = 0
    new_accepted: int = 0
    dup_keys_sent: int = 0
    upstream_received: int | None = None
    predelivered: int = 0
    predeliver_upstream: int | None = None
    delivered_s: float | None = None
    """Queue rows: accepted / (last delivery at the sink - first acceptance)."""
    drain_s: float | None = None
    """Queue rows: seconds from the end of the load to the last delivery at the sink."""
    authenticated: bool = False
    errors: dict[str, int] = field(default_factory=dict)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, float | None] = field(default_factory=dict)


# --- one running scenario --------------------------------------------------------------------
class Target:
    """The server a scenario's client talks to, with the PIDs whose memory is reported."""

    def __init__(self, port: int, pids: list[int], stop: list[Any], auth: bool = True) -> None:
        self.port = port
        self._pids = pids
        self._stop = stop
        self.auth = auth
        self.redis: Redis | None = None
        self.postfix: Postfix | None = None

    def pids(self) -> list[int]:
        if self.postfix is not None:
            return self.postfix.pids()
        return self._pids

    def cpu_roots(self) -> list[int]:
        if self.postfix is not None:
            return [self.postfix.proc.pid]
        return self._pids

    def stop(self) -> None:
        for s in reversed(self._stop):
            with contextlib.suppress(Exception):
                s.stop()


def start_target(
    scenario: str, tmp: Path, sink: Sink, pool_size: int, row_id: str, queue: dict[str, Any] | None = None
) -> Target:
    src = None
    if scenario.endswith(BASE_SUFFIX):
        scenario, src = scenario[: -len(BASE_SUFFIX)], BASE_SRC
    if scenario in QUEUE_SCENARIOS:
        if queue is None:
            raise ValueError(f"{scenario} needs a queue section")
        scenario = QUEUE_SCENARIOS[scenario]
    else:
        queue = None
    if scenario == "direct":
        return Target(sink.port, [], [])
    if scenario in ("null", "naive"):
        port = free_port()
        argv = [PY, "-m", "bench.servers", "null", str(port)]
        if scenario == "naive":
            argv = [PY, "-m", "bench.servers", "naive", str(port), str(sink.port), str(pool_size)]
        proc = Proc(scenario, argv, tmp / f"{row_id}.log")
        try:
            wait_port(port, 20, proc)
        except BaseException:
            proc.stop()
            raise
        return Target(port, [proc.pid], [proc])
    if scenario in ("guard-sqlite", "guard-sqlite-asyncio"):
        port = free_port()
        db = tmp / f"{row_id}.db"
        cfg = guard_config(port, sink.port, f"sqlite:///{db}", pool_size, queue=queue)
        if scenario == "guard-sqlite-asyncio":
            cfg["event_loop"] = "asyncio"  # what smtpguard does without the `fast` extra
        guard = Guard(tmp, row_id, cfg, src)
        return Target(port, [guard.pid], [guard])
    if scenario == "guard-redis":
        redis = Redis(tmp)
        try:
            port = free_port()
            guard = Guard(tmp, row_id, guard_config(port, sink.port, redis.url, pool_size, queue=queue), src)
        except BaseException:
            redis.stop()
            raise
        t = Target(port, [guard.pid], [redis, guard])
        t.redis = redis
        return t
    if scenario == "guard-postgres":
        pg = Postgres(tmp)
        try:
            port = free_port()
            guard = Guard(tmp, row_id, guard_config(port, sink.port, pg.url, pool_size, queue=queue), src)
        except BaseException:
            pg.stop()
            raise
        return Target(port, [guard.pid], [pg, guard])
    if scenario == "postfix":
        pf = Postfix(tmp / row_id, sink.port)
        t = Target(pf.port, [], [pf], auth=False)
        t.postfix = pf
        return t
    raise ValueError(scenario)


def scenario_available(scenario: str) -> str | None:
    """None when the scenario can run here, else why not."""
    scenario = scenario.removesuffix(BASE_SUFFIX)
    if scenario in ("guard-redis", "guard-redis-queue"):
        store = ROOT / "smtpguard" / "store"
        if not ((store / "redis.py").exists() or (store / "redis").is_dir()):
            return "smtpguard/store/redis does not exist yet"
        if shutil.which("redis-server") is None:
            return "redis-server is not installed"
    if scenario in ("guard-postgres", "guard-postgres-queue"):
        if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
            return "PostgreSQL is not installed"
        try:
            import psycopg_pool  # noqa: F401
        except ImportError:
            return "the postgres extra (psycopg, psycopg-pool) is not installed"
    if scenario == "postfix" and shutil.which("postfix") is None and not Path("/usr/sbin/postfix").exists():
        return "postfix is not installed"
    return None


# --- measuring -------------------------------------------------------------------------------
@dataclass
class Settings:
    warmup: float
    duration: float
    max_messages: int
    size: int
    dup_keys: int
    dup_ratio: float
    paced_rate: float
    pool_size: int
    pipelining: bool
    queue_workers: int = 32
    queue_poll: str = "100ms"
    drain_timeout: float = 60.0


def queue_section(s: Settings) -> dict[str, Any]:
    """smtpguard's `queue` section for the queue scenarios (short backoff, so a retried
    message still lands within the bounded drain)."""
    return {
        "backoff": {"base": "1s", "max": "5s"},
        "workers": s.queue_workers,
        "poll_interval": s.queue_poll,
    }


StartTarget = Callable[[str, Path, Sink, int, str, "dict[str, Any] | None"], Target]
"""start_target's shape: another bench (bench/cores.py) passes its own to measure()."""


def measure(
    scenario: str,
    mode: str,
    sessions: int,
    tmp: Path,
    sink: Sink,
    s: Settings,
    run_id: str,
    start: StartTarget | None = None,
) -> Row:
    row = Row(scenario, mode, sessions)
    row_id = f"{scenario}-{mode}-{sessions}".replace("@", "-w")
    queued = scenario in QUEUE_SCENARIOS
    target = (start or start_target)(
        scenario, tmp, sink, s.pool_size, row_id, queue_section(s) if queued else None
    )
    slow_drain = scenario == "postfix"
    try:
        prefix = f"{run_id}:{row_id}"
        pool: list[str] = []
        if mode == "dup":
            pool = [f"{prefix}:pre:{i}" for i in range(s.dup_keys)]
            before = sink.settled_count(quiet=0.2)
            pre = asyncio.run(deliver_keys(target.port, pool, sessions, target.auth, s.size))
            row.predelivered = pre.new_accepted
            row.predeliver_upstream = sink.settled_count(quiet=1.0 if slow_drain else 0.3) - before
            if pre.errors:
                row.errors.update({f"predeliver {k}": v for k, v in pre.errors.items()})
        before = sink.settled_count(quiet=1.0 if slow_drain else 0.2)
        cpu: dict[str, float] = {}
        roots = target.cpu_roots()

        def on_window(edge: str) -> None:
            cpu[f"proxy_{edge}"] = sum(cpu_seconds(p) for p in roots)
            t = os.times()
            cpu[f"client_{edge}"] = t.user + t.system

        on_window("begin")
        res: LoadResult = asyncio.run(
            run_load(
                target.port,
                sessions,
                auth=target.auth,
                key_prefix=prefix,
                warmup=s.warmup,
                duration=s.duration,
                max_messages=s.max_messages,
                size=s.size,
                dup_pool=pool or None,
                dup_ratio=s.dup_ratio if pool else 0.0,
                rate=s.paced_rate if mode == "paced" else None,
                pipelining=s.pipelining,
                seed=zlib.crc32(row_id.encode()),
                on_window=on_window,
            )
        )
        if queued:
            drain(row, res, sink, before, s.drain_timeout)
            on_window("drained")
            if res.new_accepted:
                row.extra["cpu_ms_per_msg_load_and_drain"] = round(
                    1000 * (cpu["proxy_drained"] - cpu["proxy_begin"]) / res.new_accepted, 2
                )
        if res.measured and "proxy_end" in cpu:
            if roots:
                row.proxy_cpu_ms_per_msg = 1000 * (cpu["proxy_end"] - cpu["proxy_start"]) / res.measured
            row.client_cpu_ms_per_msg = 1000 * (cpu["client_end"] - cpu["client_start"]) / res.measured
        pids = target.pids()
        target_pids = pids
        if pids:
            row.extra["processes"] = len(pids)
            row.rss_mb, row.hwm_mb = memory_mb(pids)
            row.extra["pss_mb"] = round(pss_mb(pids), 1)
        if target.redis is not None:
            row.extra["redis_used_memory_mb"] = round(target.redis.used_memory() / 1e6, 2)
            row.extra["redis_rss_mb"] = round(memory_mb([target.redis.proc.pid])[0], 2)
        if target.postfix is not None:
            row.extra["postfix_processes"] = len(pids)
        if not queued:
            row.upstream_received = sink.settled_count(quiet=1.5 if slow_drain else 0.3, timeout=60) - before
    finally:
        target.stop()
    row.msgs_s = res.rate
    row.p50_ms = res.percentile(50)
    row.p99_ms = res.percentile(99)
    row.measured = res.measured
    row.window_s = res.window
    row.sent = res.sent_total
    row.ok = res.ok_total
    row.duplicates_answered = res.duplicates_answered
    row.new_accepted = res.new_accepted
    row.dup_keys_sent = res.dup_keys_sent
    row.authenticated = res.authenticated
    row.errors.update(res.errors)
    if scenario == "postfix":
        row.note = f"no AUTH (mynetworks); {len(target_pids)} procs, PSS {row.extra.get('pss_mb', '-')} MB"
    elif scenario == "direct":
        row.note = f"{sink.kind}, AUTH {'yes' if res.authenticated else 'not offered'}"
    elif scenario == "null":
        row.note = "AUTH accepted unchecked"
    return row


def drain(row: Row, res: LoadResult, sink: Sink, before: int, timeout: float) -> None:
    """Queue rows: wait (bounded) until the sink has everything accepted, then a quiet
    0.5 s for anything extra (a duplicate delivery); delivered/s = accepted / (time of the
    last delivery - time of the first acceptance)."""
    load_end = time.perf_counter()
    accepted = res.new_accepted
    reached = sink.wait_for(before + accepted, timeout)
    row.upstream_received = sink.settled_count(quiet=0.5, timeout=10) - before
    last = sink.changed_at
    row.extra["drain_complete"] = reached
    if res.first_accept_at is None or not accepted:
        return
    if not reached:
        # Lost, or not delivered within the bound: a lower bound over the whole wait.
        last = time.perf_counter()
        row.note = f"drain timed out after {timeout:g}s: {row.upstream_received}/{accepted} delivered"
    span = last - res.first_accept_at
    row.delivered_s = (row.upstream_received or 0) / span if span > 0 else None
    row.drain_s = max(0.0, last - load_end)
    row.extra["delivery_span_s"] = round(span, 3)
    if res.last_accept_at is not None:
        row.extra["acceptance_span_s"] = round(res.last_accept_at - res.first_accept_at, 3)


def measure_retrying(
    scenario: str,
    mode: str,
    n: int,
    tmp: Path,
    sink: Sink,
    s: Settings,
    run_id: str,
    start: StartTarget | None = None,
) -> Row:
    """measure(), once more after 2 s if the server did not start (e.g. smtpguard's tree was
    mid-edit by someone else); a row that fails twice says why in its note."""
    row = Row(scenario, mode, n)
    for attempt in range(2):
        try:
            return measure(scenario, mode, n, tmp, sink, s, f"{run_id}a{attempt}", start)
        except (RuntimeError, TimeoutError, OSError) as e:
            last = (str(e).strip().splitlines() or [""])[-1]
            row = Row(scenario, mode, n, note=f"FAILED: {last}"[:200])
            row.errors["failed"] = 1
            print(f"{scenario} {mode} {n}: attempt {attempt + 1} failed: {last}", flush=True)
            time.sleep(2)
    return row


def medians(rows: list[Row]) -> list[Row]:
    """One row per (scenario, mode, sessions): the round with the median msgs/s (all its
    numbers from that one round), with every round's msgs/s kept in extra."""
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.scenario, r.mode, r.sessions), []).append(r)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        ranked = sorted(group, key=lambda r: r.msgs_s)
        pick = ranked[(len(ranked) - 1) // 2]
        pick.extra["rounds_msgs_s"] = [round(r.msgs_s, 1) for r in group]
        spread = "/".join(f"{r.msgs_s:.0f}" for r in group)
        pick.note = f"rounds {spread}" + (f"; {pick.note}" if pick.note else "")
        out.append(pick)
    return out


def add_ratios(rows: list[Row]) -> None:
    index = {(r.scenario, r.mode, r.sessions): r for r in rows}
    for r in rows:
        before = index.get((r.scenario + BASE_SUFFIX, r.mode, r.sessions))
        if before is not None:
            r.ratios["vs_base"] = round(r.msgs_s / before.msgs_s, 3) if before.msgs_s > 0 else None
            a, b = r.proxy_cpu_ms_per_msg, before.proxy_cpu_ms_per_msg
            r.ratios["cpu_vs_base"] = round(a / b, 3) if a and b else None
        for base in BASELINES:
            b = index.get((base, r.mode, r.sessions))
            r.ratios[base] = round(r.msgs_s / b.msgs_s, 3) if b and b.msgs_s > 0 else None
        if r.scenario in QUEUE_SCENARIOS:
            relay = index.get((QUEUE_SCENARIOS[r.scenario], r.mode, r.sessions))
            d = r.delivered_s
            r.ratios["delivered_vs_relay"] = (
                round(d / relay.msgs_s, 3) if relay and relay.msgs_s > 0 and d is not None else None
            )
            p99 = r.p99_ms
            r.ratios["p99_vs_10ms"] = None if math.isnan(p99) else round(p99 / QUEUE_P99_TARGET_MS, 3)


# --- output ----------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def table(rows: list[Row]) -> str:
    head = (
        f"{'scenario':<20} {'mode':<7} {'sess':>4} {'msgs/s':>8} {'delivered/s':>11} "
        f"{'p50ms':>7} {'p99ms':>7} "
        f"{'RSS MB':>7} {'HWM MB':>7} {'cpu/msg':>7} {'/direct':>7} {'/null':>6} {'/naive':>6} "
        f"{'errors':>6}  note"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        errs = sum(r.errors.values())
        lines.append(
            f"{r.scenario:<20} {r.mode:<7} {r.sessions:>4} {r.msgs_s:>8.0f} {_f(r.delivered_s, 0):>11} "
            f"{_f(r.p50_ms, 2):>7} "
            f"{_f(r.p99_ms, 2):>7} {_f(r.rss_mb):>7} {_f(r.hwm_mb):>7} {_f(r.proxy_cpu_ms_per_msg, 2):>7} "
            f"{_f(r.ratios.get('direct'), 2):>7} {_f(r.ratios.get('null'), 2):>6} "
            f"{_f(r.ratios.get('naive'), 2):>6} {errs:>6}  {r.note}"
        )
    return "\n".join(lines)


def base_lines(rows: list[Row]) -> list[str]:
    """This checkout against --baseline, row by row: msgs/s and CPU per message."""
    out = []
    for r in rows:
        if "vs_base" in r.ratios:
            out.append(
                f"{r.scenario:<20} {r.mode:<7} {r.sessions:>4}  msgs/s {_f(r.ratios['vs_base'], 2)}x of "
                f"{r.scenario}{BASE_SUFFIX}, cpu/msg {_f(r.ratios.get('cpu_vs_base'), 2)}x"
            )
    return out


def dup_checks(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        if not r.scenario.startswith("guard"):
            continue
        if r.mode == "dup":
            dups_upstream = (r.upstream_received or 0) - r.new_accepted
            pre_ok = r.predeliver_upstream == r.predelivered
            verdict = "OK: zero duplicates upstream" if dups_upstream == 0 and pre_ok else "FAIL"
            out.append(
                f"{r.scenario} dup {r.sessions:>2} sessions: pre-delivered {r.predelivered} keys "
                f"(sink +{r.predeliver_upstream}); storm sent {r.sent} ({r.dup_keys_sent} repeats of "
                f"delivered keys), {r.duplicates_answered} answered 'duplicate', {r.new_accepted} new "
                f"accepted, sink received {r.upstream_received} -> {dups_upstream} extra upstream: {verdict}"
            )
        elif r.scenario in QUEUE_SCENARIOS:
            got = r.upstream_received or 0
            extra, lost = max(0, got - r.new_accepted), max(0, r.new_accepted - got)
            verdict = "OK: zero duplicates, zero lost" if got == r.new_accepted else "FAIL"
            span = r.extra.get("delivery_span_s")
            out.append(
                f"{r.scenario} {r.mode} {r.sessions:>2} sessions: {r.new_accepted} queued, sink received "
                f"{got} in {_f(span, 2)} s from the first acceptance ({_f(r.drain_s, 2)} s after the "
                f"load stopped) -> {extra} duplicates, {lost} lost: {verdict}"
            )
        else:
            extra = (r.upstream_received or 0) - r.new_accepted
            out.append(
                f"{r.scenario} {r.mode} {r.sessions:>2} sessions: {r.new_accepted} accepted, sink received "
                f"{r.upstream_received} ({'OK' if extra == 0 else f'MISMATCH {extra:+d}'})"
            )
    return out


def targets(rows: list[Row], idle: dict[str, Any] | None = None) -> list[str]:
    index = {(r.scenario, r.mode, r.sessions): r for r in rows}
    out = []

    def ratio(a: str, mode: str, n: int, b: str) -> float | None:
        ra, rb = index.get((a, mode, n)), index.get((b, mode, n))
        if ra and rb and rb.msgs_s > 0:
            return ra.msgs_s / rb.msgs_s
        return None

    def line(name: str, value: float | None, goal: float, fmt: str = "{:.2f}x") -> None:
        if value is None:
            out.append(f"  {name}: not measured")
        else:
            verdict = "MET" if value >= goal else "NOT MET"
            out.append(f"  {name}: {fmt.format(value)} (target {fmt.format(goal)}) {verdict}")

    line("guard-sqlite / naive @50 unique", ratio("guard-sqlite", "unique", 50, "naive"), 0.8)
    line(
        "guard-sqlite on asyncio's own loop / naive @50 unique",
        ratio("guard-sqlite-asyncio", "unique", 50, "naive"),
        0.8,
    )
    line("guard-redis  / naive @50 unique", ratio("guard-redis", "unique", 50, "naive"), 0.8)
    line("guard-postgres / naive @50 unique", ratio("guard-postgres", "unique", 50, "naive"), 0.8)
    # The stores side by side (no target: what the choice of store costs, docs/stores.md).
    for mode in ("unique", "dup"):
        for other in ("guard-sqlite", "guard-redis"):
            x = ratio("guard-postgres", mode, 50, other)
            if x is not None:
                out.append(f"  guard-postgres / {other} @50 {mode}: {x:.2f}x")
    for q in ("guard-sqlite-queue", "guard-redis-queue"):
        a, b = index.get(("guard-postgres-queue", "unique", 50)), index.get((q, "unique", 50))
        if a and b and a.delivered_s and b.delivered_s:
            out.append(
                f"  guard-postgres-queue / {q} delivered/s @50 unique: {a.delivered_s / b.delivered_s:.2f}x"
            )
    line("guard-sqlite / postfix @50 unique", ratio("guard-sqlite", "unique", 50, "postfix"), 1.0)
    line("guard-redis  / postfix @50 unique", ratio("guard-redis", "unique", 50, "postfix"), 1.0)
    line("guard-sqlite dup / null dup @50", ratio("guard-sqlite", "dup", 50, "null"), 0.8)
    line("guard-redis  dup / null dup @50", ratio("guard-redis", "dup", 50, "null"), 0.8)
    line("guard-postgres dup / null dup @50", ratio("guard-postgres", "dup", 50, "null"), 0.8)
    for q, relay in QUEUE_SCENARIOS.items():
        for n in sorted({r.sessions for r in rows if r.scenario == q}):
            r = index.get((q, "unique", n))
            if r is None:
                continue
            goal = " (the target)" if n == 50 else ""
            p99, limit = r.p99_ms, QUEUE_P99_TARGET_MS
            if not math.isnan(p99):
                out.append(
                    f"  {q} acceptance p99 @{n} unique: {p99:.2f} ms = {p99 / limit:.2f}x of the "
                    f"{limit:g} ms target{goal} {'MET' if p99 <= limit else 'NOT MET'}"
                )
            rr = index.get((relay, "unique", n))
            if r.delivered_s is None or rr is None or rr.msgs_s <= 0:
                out.append(f"  {q} delivered/s @{n} unique vs {relay}: not measured")
                continue
            x = r.delivered_s / rr.msgs_s
            out.append(
                f"  {q} delivered/s @{n} unique: {r.delivered_s:.1f} vs {relay} {rr.msgs_s:.1f} msgs/s = "
                f"{x:.3f}x (target >= 1.00x){goal} {'MET' if x >= 1.0 else 'NOT MET'}"
            )
        r = index.get((q, "paced", 10))
        if r is not None and not math.isnan(r.p99_ms):
            out.append(
                f"  {q} acceptance p99 @10 paced (service time, no queueing): {r.p99_ms:.2f} ms = "
                f"{r.p99_ms / QUEUE_P99_TARGET_MS:.2f}x of {QUEUE_P99_TARGET_MS:g} ms (p50 {r.p50_ms:.2f})"
            )
    for mode in ("unique", "paced"):
        d = index.get(("direct", mode, 10))
        for g in ("guard-sqlite", "guard-redis", "guard-postgres"):
            r = index.get((g, mode, 10))
            if d and r:
                added = r.p99_ms - d.p99_ms
                out.append(
                    f"  {g} p99 added latency @10 {mode}: {added:.2f} ms (p99 {r.p99_ms:.2f} vs direct "
                    f"{d.p99_ms:.2f}) (target <= 5 ms) {'MET' if added <= 5 else 'NOT MET'}"
                )
    return out


def git_state() -> dict[str, Any]:
    def run(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    h = hashlib.sha256()
    for p in sorted((ROOT / "smtpguard").rglob("*.py")):
        h.update(p.relative_to(ROOT).as_posix().encode())
        h.update(p.read_bytes())
    return {
        "head": run("rev-parse", "HEAD"),
        "smtpguard_dirty": run("status", "--short", "--", "smtpguard").splitlines(),
        "smtpguard_tree_sha256": h.hexdigest()[:16],
    }


# --- profile ---------------------------------------------------------------------------------
def py_spy() -> str | None:
    cand = Path(PY).parent / "py-spy"
    return str(cand) if cand.exists() else shutil.which("py-spy")


def profile(
    tmp: Path,
    sink: Sink,
    s: Settings,
    seconds: int,
    sessions: int,
    out_dir: Path,
    store: str = "sqlite",
    mode: str = "unique",
) -> dict[str, Any]:
    """py-spy smtpguard under `sessions` sessions: an SVG flame graph (CPU: samples of
    running threads), a raw collapsed-stack file of the same, and one with --idle (wall
    time: where threads wait too). The top functions of each are summarized."""
    exe = py_spy()
    if exe is None:
        return {"error": "py-spy not installed: .venv/bin/pip install py-spy"}
    port = free_port()
    # The same private servers the guard-redis and guard-postgres scenarios start.
    server: Redis | Postgres | None = (
        Redis(tmp) if store == "redis" else Postgres(tmp) if store == "postgres" else None
    )
    url = server.url if server else f"sqlite:///{tmp / 'profile.db'}"
    try:
        guard = Guard(tmp, "profile", guard_config(port, sink.port, url, s.pool_size))
    except BaseException:
        if server:
            server.stop()
        raise
    suffix = ("" if store == "sqlite" else f"-{store}") + ("" if mode == "unique" else f"-{mode}")
    svg, raw = out_dir / f"profile{suffix}.svg", out_dir / f"profile{suffix}.txt"
    wall = out_dir / f"profile{suffix}-wall.txt"
    result: dict[str, Any] = {"store": store, "mode": mode, "sessions": sessions, "seconds": seconds}
    spies: list[subprocess.Popen[bytes]] = []
    load: dict[str, LoadResult] = {}
    try:
        prefix = f"profile:{stamp()}"
        pool: list[str] = []
        if mode == "dup":
            pool = [f"{prefix}:pre:{i}" for i in range(s.dup_keys)]
            asyncio.run(deliver_keys(port, pool, sessions, True, s.size))

        def drive() -> None:
            load["r"] = asyncio.run(
                run_load(
                    port, sessions, auth=True, key_prefix=prefix, warmup=1.0,
                    duration=seconds + 3.0, max_messages=10**7, size=s.size,
                    dup_pool=pool or None, dup_ratio=s.dup_ratio if pool else 0.0,
                )
            )  # fmt: skip

        th = threading.Thread(target=drive, name="profile-load")
        th.start()
        time.sleep(1.5)
        common = ["--pid", str(guard.pid), "-d", str(seconds), "-r", "100", "--nonblocking"]
        spies.append(subprocess.Popen([exe, "record", "-o", str(svg), *common], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE))  # fmt: skip
        raw_args = ["record", "-f", "raw", "--nolineno", "--threads"]
        for extra, out in (([], raw), (["--idle"], wall)):
            spies.append(
                subprocess.Popen(
                    [exe, *raw_args, *extra, "-o", str(out), *common],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        for p in spies:
            try:
                _, err = p.communicate(timeout=seconds + 60)
                if p.returncode:
                    result.setdefault("errors", []).append(err.decode(errors="replace")[-500:])
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        th.join(seconds + 60)
    finally:
        for p in spies:
            if p.poll() is None:
                p.kill()
                p.wait()
        guard.stop()
        if server:
            server.stop()
    if "r" in load:
        result["msgs_s_under_profiler"] = round(load["r"].rate, 1)
        result["p99_ms_under_profiler"] = round(load["r"].percentile(99), 2)
    if raw.exists():
        result["cpu"] = summarize_raw(raw)
    if wall.exists():
        result["wall"] = summarize_raw(wall)
    result["files"] = [str(p.relative_to(ROOT)) for p in (svg, raw, wall) if p.exists()]
    return result


def summarize_raw(path: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares per function, per thread kind, from py-spy's raw
    (collapsed stack) output: `thread (…);frame;frame… COUNT`."""
    self_c: dict[str, int] = {}
    incl_c: dict[str, int] = {}
    threads: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        thread = frames[0]
        frames = frames[1:] if thread.startswith(("thread", "process")) else frames
        tname = _thread_kind(thread)
        threads[tname] = threads.get(tname, 0) + count
        total += count
        if not frames:
            continue
        leaf = frames[-1]
        self_c[leaf] = self_c.get(leaf, 0) + count
        for f in set(frames):
            incl_c[f] = incl_c.get(f, 0) + count

    def pct(d: dict[str, int], n: int = top) -> list[tuple[str, float]]:
        return [(k, round(100 * v / total, 1)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]

    marks = ("smtpguard/", "aiosmtpd/", "aiosmtplib/", "redis/", "sqlite", "email/", "json/")
    focus = {k: v for k, v in incl_c.items() if any(m in k for m in marks)}
    return {
        "samples": total,
        "top_focus_inclusive_pct": pct(focus, 40),
        "threads_pct": {
            k: round(100 * v / total, 1) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
        },
        "top_self_pct": pct(self_c),
        "top_inclusive_pct": pct(incl_c),
    }


def _thread_kind(frame: str) -> str:
    low = frame.lower()
    for name in ("sqlite-writer", "sqlite-read", "asyncio", "mainthread"):
        if name in low:
            return name
    return frame[:60]


# --- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 s per measurement, fewer pre-delivered keys")
    ap.add_argument("--sessions", default="1,10,50")
    ap.add_argument("--scenarios", default=",".join(ALL_SCENARIOS))
    ap.add_argument("--modes", default="unique,dup,paced")
    ap.add_argument("--duration", type=float, help="seconds measured per row (default 3, quick 1)")
    ap.add_argument("--warmup", type=float, help="seconds of warm-up per row (default 0.5, quick 0.3)")
    ap.add_argument("--max-messages", type=int, default=100_000, help="stop a row after this many")
    ap.add_argument("--size", type=int, default=2000, help="approximate message size in bytes")
    ap.add_argument("--dup-keys", type=int, help="keys pre-delivered for the duplicate storm")
    ap.add_argument("--dup-ratio", type=float, default=0.9)
    ap.add_argument("--paced-rate", type=float, default=50.0, help="msgs/s over 10 sessions in paced mode")
    ap.add_argument("--pool-size", type=int, default=8, help="upstream pool of naive and smtpguard")
    ap.add_argument("--pipelining", action="store_true", help="pipeline MAIL/RCPT/DATA where offered")
    ap.add_argument("--queue-workers", type=int, default=32, help="queue.workers of the *-queue scenarios")
    ap.add_argument("--queue-poll", default="100ms", help="queue.poll_interval of the *-queue scenarios")
    ap.add_argument(
        "--drain-timeout", type=float, default=60.0,
        help="queue rows: longest wait after the load for the sink to receive everything accepted",
    )  # fmt: skip
    ap.add_argument("--python-sink", action="store_true", help="use bench/sink.py even if smtp-sink exists")
    ap.add_argument("--profile", action="store_true", help="after the table, py-spy smtpguard+SQLite")
    ap.add_argument("--profile-only", action="store_true", help="only the py-spy profile")
    ap.add_argument("--profile-seconds", type=int, default=10)
    ap.add_argument("--profile-sessions", type=int, default=50)
    ap.add_argument("--profile-store", default="sqlite", choices=["sqlite", "redis", "postgres"])
    ap.add_argument("--profile-mode", default="unique", choices=["unique", "dup"])
    ap.add_argument(
        "--log-level", default="warning", help="smtpguard's log level (info: one decision line a message)"
    )
    ap.add_argument("--keep-tmp", action="store_true")
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="also run every guard scenario from `git archive REV` (before/after in one run)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over every scenario (interleaved); the table shows each row's median round",
    )
    args = ap.parse_args(argv)
    install_sigterm()
    bench_common.LOG_LEVEL = args.log_level

    s = Settings(
        warmup=args.warmup if args.warmup is not None else (0.3 if args.quick else 0.5),
        duration=args.duration if args.duration is not None else (1.0 if args.quick else 3.0),
        max_messages=args.max_messages,
        size=args.size,
        dup_keys=args.dup_keys if args.dup_keys is not None else (200 if args.quick else 500),
        dup_ratio=args.dup_ratio,
        paced_rate=args.paced_rate,
        pool_size=args.pool_size,
        pipelining=args.pipelining,
        queue_workers=args.queue_workers,
        queue_poll=args.queue_poll,
        drain_timeout=args.drain_timeout,
    )
    sessions_list = [int(x) for x in args.sessions.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    scenarios = [x for x in args.scenarios.split(",") if x]
    global BASE_SRC
    base_tmp: Path | None = None
    if args.baseline:
        # Each guard scenario twice, the baseline's right after this checkout's, so both see
        # the same machine (the rounds interleave them too).
        base_tmp = Path(tempfile.mkdtemp(prefix="smtpguard-base-"))
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "smtpguard"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(base_tmp)], input=archive, check=True)
        BASE_SRC = base_tmp
        # Relay scenarios only: a queue row's bookkeeping keys on its scenario's name.
        twice = [x for x in scenarios if x.startswith("guard") and x not in QUEUE_SCENARIOS]
        scenarios = [y for x in scenarios for y in ([x, x + BASE_SUFFIX] if x in twice else [x])]
    run_id = stamp()
    git_at_start = git_state()
    password_hash()  # once, before any clock starts

    all_rows: list[Row] = []
    skipped: dict[str, str] = {}
    prof: dict[str, Any] | None = None
    started = time.monotonic()
    with workdir("smtpguard-bench-", keep=args.keep_tmp) as tmp:
        sink = Sink(tmp, force_python=args.python_sink)
        print(f"sink: {sink.kind} on 127.0.0.1:{sink.port}; tmp {tmp}", flush=True)
        try:
            for rnd in range(0 if args.profile_only else args.repeat):
                if args.repeat > 1:
                    print(f"--- round {rnd + 1}/{args.repeat}", flush=True)
                for scenario in scenarios:
                    why = scenario_available(scenario)
                    if why:
                        skipped[scenario] = why
                        print(f"skip {scenario}: {why}", flush=True)
                        continue
                    for n in sessions_list:
                        for mode in modes:
                            if mode == "paced" and n != 10:
                                continue
                            if scenario in QUEUE_SCENARIOS and mode not in QUEUE_MODES:
                                continue
                            t0 = time.monotonic()
                            row = measure_retrying(scenario, mode, n, tmp, sink, s, f"{run_id}r{rnd}")
                            all_rows.append(row)
                            queued = scenario in QUEUE_SCENARIOS
                            dl = f"delivered {_f(row.delivered_s, 0)}/s  " if queued else ""
                            print(
                                f"{scenario:<20} {mode:<7} {n:>3}: {row.msgs_s:8.0f} msgs/s  {dl}p50 "
                                f"{_f(row.p50_ms, 2)} p99 {_f(row.p99_ms, 2)} ms  rss {_f(row.rss_mb)} MB  "
                                f"cpu/msg {_f(row.proxy_cpu_ms_per_msg, 2)} ms "
                                f"(client {_f(row.client_cpu_ms_per_msg, 2)})  "
                                f"errors {dict(row.errors) or 0}  ({time.monotonic() - t0:.1f}s)",
                                flush=True,
                            )
            if args.profile or args.profile_only:
                RESULTS.mkdir(parents=True, exist_ok=True)
                prof = profile(
                    tmp,
                    sink,
                    s,
                    args.profile_seconds,
                    args.profile_sessions,
                    RESULTS,
                    args.profile_store,
                    args.profile_mode,
                )
        finally:
            sink.stop()

    rows = medians(all_rows)
    add_ratios(rows)
    payload: dict[str, Any] = {
        "run_id": run_id,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "git": git_state(),
        "git_at_start": git_at_start,
        "settings": asdict(s),
        "sink": sink.kind,
        "skipped": skipped,
        "elapsed_s": round(time.monotonic() - started, 1),
        "rows": [asdict(r) for r in rows],
        "all_rounds": [asdict(r) for r in all_rows] if args.repeat > 1 else None,
    }
    if payload["git"] != git_at_start:
        print("\nnote: smtpguard/ changed during this run (other engineers' edits); see git/git_at_start")
    if rows:
        print()
        print(table(rows))
        print()
        print("Ledger check (counted at the sink):")
        checks = dup_checks(all_rows)
        for c in checks:
            print("  " + c)
        print("Targets:")
        tl = targets(rows)
        for t in tl:
            print(t)
        payload["dup_checks"] = checks
        payload["targets"] = tl
        if args.baseline:
            bl = base_lines(rows)
            print(f"This checkout against {args.baseline} (same run, ratio of the median rounds):")
            for line in bl:
                print("  " + line)
            payload["baseline"] = {"rev": args.baseline, "lines": bl}
    if base_tmp is not None:
        shutil.rmtree(base_tmp, ignore_errors=True)
        print(
            f"\nnotes: postfix rows send without AUTH from 127.0.0.1 (mynetworks); RSS for postfix is the "
            f"sum over its master and children; redis-server runs with appendonly no and no snapshots; "
            f"each row starts a fresh proxy; {s.duration:g}s measured after {s.warmup:g}s warm-up; "
            f"messages ~{s.size} B; upstream pool {s.pool_size}; load avg now {os.getloadavg()[0]:.2f}"
        )
    if prof is not None:
        payload["profile"] = prof
        print("\nprofile:", {k: v for k, v in prof.items() if k not in ("cpu", "wall")})
        for kind in ("cpu", "wall"):
            summary = prof.get(kind)
            if not summary:
                continue
            print(f"  [{kind}] samples {summary['samples']}, threads {summary['threads_pct']}")
            for title, key, n in (
                ("self", "top_self_pct", 20),
                ("inclusive", "top_inclusive_pct", 12),
                ("inclusive, smtpguard and its libraries", "top_focus_inclusive_pct", 40),
            ):
                if kind == "wall" and key != "top_self_pct":
                    continue
                print(f"  [{kind}] top {title}:")
                for name, p in summary.get(key, [])[:n]:
                    print(f"    {p:5.1f}%  {name}")
    path = write_result("relay", payload)
    print(f"\nwrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
