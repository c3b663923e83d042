"""Every core: smtpguard with `workers: 1` and `workers: auto`, beside Postfix (default and
tuned) and the naive relay, on SQLite, Redis and PostgreSQL, with the outbox's drain and the
verdict loop's cost, in one run (issues 19 and 30, DESIGN.md §17, §19, §20).

    .venv/bin/python -m bench.cores --quick      # ~2 min: 1 s per measurement, one round
    .venv/bin/python -m bench.cores              # 3 s per measurement
    .venv/bin/python -m bench.cores --repeat 3   # 3 interleaved rounds, each row its median round

Scenarios, all in front of the same upstream sink (Postfix's smtp-sink when installed), at
50 sessions of the asyncio load client (bench/client.py):
  null             a bare aiosmtpd listener (250, relays nothing): the duplicate storm's yardstick
  naive            aiosmtpd + aiosmtplib pass-through with pooled upstream connections
  postfix          a private Postfix with its default settings (relayhost = the sink; the
                   clients send without AUTH from 127.0.0.1, mynetworks)
  postfix-tuned    the same Postfix tuned for relaying (bench.common.tuned_settings:
                   in_flow_delay = 0, default_process_limit = 200, connections to the
                   relayhost cached); Postfix queues, so both Postfix rows wait for the sink
                   to go quiet (1.5 s) before counting it
  guard-STORE@1    `python -m smtpguard serve`, one process (no `workers` key: the default)
  guard-STORE@auto the same with `workers: auto` (a supervisor and one worker per core)
with STORE sqlite, redis (a private redis-server, no fsync) and postgres (a private
PostgreSQL, fsync on). Modes: `unique` (every message a new event) for every relaying
scenario; `dup` (the duplicate storm: 90% of the submissions repeat keys delivered before)
for null and the guards.

Beside SMTP, per store: `outbox-STORE@1 drain`, a backlog of --outbox-rows rows (10,000;
2,000 with --quick) committed in one transaction into the application's PostgreSQL and
drained by one smtpguard process (no `workers` key), msgs/s = rows / (last receipt -
COMMIT), with its CPU per message (bench/outbox.py). And once per run, the verdict loop at
--verdict-records unknown records (bench/verdicts.py, SQLite store, in-process with an
injected clock): the CPU of its rounds per record settled and their wall time.

Columns: msgs/s; p50/p99 latency; `cpu/msg`, the user+system CPU of the server's processes
(the supervisor, its workers and every child, from /proc) over the measured window divided
by the messages measured (redis-server and PostgreSQL excluded); the sink's count against
the 250s the client got (0 duplicates and 0 lost in every relaying row); ratios. A build
of smtpguard that refuses the `workers` key (a config error) gets its @auto rows printed as
"n/a (workers not supported by this build)". JSON goes to bench/results/cores-STAMP.json,
and, when matplotlib is importable, a chart to bench/results/cores-STAMP.png.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    PY,
    ROOT,
    Guard,
    Postfix,
    Sink,
    descendants,
    free_port,
    guard_config,
    install_sigterm,
    machine_info,
    password_hash,
    stamp,
    start_store,
    workdir,
    write_result,
)
from bench.relay import (
    Row,
    Settings,
    Target,
    _f,
    git_state,
    measure_retrying,
    medians,
    scenario_available,
    start_target,
)

STORES = ("sqlite", "redis", "postgres")
WORKERS = ("1", "auto")
NA_WORKERS = "n/a (workers not supported by this build)"
POSTFIX_TUNED = "postfix-tuned"
DRAIN = "drain"
"""The mode of the outbox rows (scenario outbox-STORE@1)."""
POSTFIX_QUIET = 1.5
"""Seconds the sink must stay still before a Postfix row counts it (bench.relay waits as
long for its `postfix` row): Postfix hands messages on from its queue, not in the session."""

# Issue 30's targets, per store.
NAIVE_GOAL = {"sqlite": 0.8, "redis": 0.8, "postgres": 0.65}
CPU_GOAL_MS = {"sqlite": 1.9, "redis": 1.9, "postgres": 2.4}
ISSUE_NAIVE_CPU_MS = 1.54
"""The naive relay's CPU per message on the machine the issue's targets were measured on."""
AUTO_GOAL = {"sqlite": 1.2, "redis": 1.4, "postgres": 1.4}
POSTFIX_GOAL = 1.8
NULL_GOAL = 0.9
"""Issue 30: duplicates answered at 0.9x the bare listener (issue 19 asked 0.8x)."""


def guard_scenarios(stores: tuple[str, ...] = STORES) -> list[str]:
    return [f"guard-{store}@{w}" for store in stores for w in WORKERS]


def split(scenario: str) -> tuple[str, str | None]:
    """'guard-redis@auto' -> ('guard-redis', 'auto'); a baseline has no workers part."""
    base, _, workers = scenario.partition("@")
    return base, workers or None


def modes_for(scenario: str) -> tuple[str, ...]:
    if scenario.startswith("outbox-"):
        return (DRAIN,)
    if scenario == "null":
        return ("dup",)
    if scenario.startswith("guard-"):
        return ("unique", "dup")
    return ("unique",)


class _Tree(Target):
    """A server that may fork (a supervisor and its workers): memory over every process."""

    def pids(self) -> list[int]:
        return [p for root in self._pids for p in descendants(root)]


def start(
    scenario: str, tmp: Path, sink: Sink, pool_size: int, row_id: str, queue: dict[str, Any] | None = None
) -> Target:
    base, workers = split(scenario)
    if scenario == POSTFIX_TUNED:
        pf = Postfix(tmp / row_id, sink.port, tuned=True)
        t = Target(pf.port, [], [pf], auth=False)
        t.postfix = pf
        return t
    if workers is None:
        return start_target(scenario, tmp, sink, pool_size, row_id, queue)
    store = base.removeprefix("guard-")
    stop: list[Any] = []
    try:
        url = start_store(store, tmp, row_id, stop)
        port = free_port()
        cfg = guard_config(port, sink.port, url, pool_size)
        if workers != "1":
            cfg["workers"] = workers
        guard = Guard(tmp, row_id, cfg)
    except BaseException:
        for s in reversed(stop):
            s.stop()
        raise
    t = _Tree(port, [guard.pid], [*stop, guard])
    if store == "redis":
        t.redis = stop[0]
    return t


def workers_supported(tmp: Path) -> tuple[bool, str]:
    """Does this smtpguard accept `workers: auto`? Asked once, of check-config, before the run."""
    cfg = guard_config(free_port(), free_port(), f"sqlite:///{tmp / 'probe.db'}", 8)
    cfg["workers"] = "auto"
    path = tmp / "workers-probe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    p = subprocess.run(
        [PY, "-m", "smtpguard", "check-config", "-c", str(path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    out = (p.stdout + p.stderr).strip()
    if p.returncode == 0:
        return True, ""
    return False, out.splitlines()[-1] if out else f"check-config exited {p.returncode}"


def store_reason(store: str) -> str | None:
    """None when smtpguard on `store` can run here, else why not."""
    if store == "redis":
        # bench.relay.scenario_available looks for smtpguard/store/redis.py, which became
        # the package smtpguard/store/redis/: by that test every Redis row would be skipped.
        if importlib.util.find_spec("smtpguard.store.redis") is None:
            return "smtpguard has no Redis store"
        return None if shutil.which("redis-server") else "redis-server is not installed"
    return scenario_available(f"guard-{store}")


def scenario_reason(scenario: str) -> str | None:
    """None when `scenario` can run here, else why not."""
    base = split(scenario)[0]
    if scenario == POSTFIX_TUNED:
        return scenario_available("postfix")
    if base.startswith("outbox-"):
        # The outbox is a PostgreSQL table of the application's, whatever the ledger's store.
        return store_reason("postgres") or store_reason(base.removeprefix("outbox-"))
    if base.startswith("guard-"):
        return store_reason(base.removeprefix("guard-"))
    return scenario_available(base)


def measure_postfix_tuned(tmp: Path, sink: Sink, s: Settings, sessions: int, run_id: str) -> Row:
    # bench.relay.measure() waits POSTFIX_QUIET for its own `postfix` row only, by name.
    sink.min_quiet = POSTFIX_QUIET
    try:
        row = measure_retrying(POSTFIX_TUNED, "unique", sessions, tmp, sink, s, run_id, start)
    finally:
        sink.min_quiet = 0.0
    if not row.errors.get("failed"):
        row.note = (
            f"no AUTH (mynetworks); in_flow_delay 0, connection cache; {row.extra.get('processes', '-')} "
            f"procs, PSS {row.extra.get('pss_mb', '-')} MB"
        )
    return row


def measure_drain(scenario: str, tmp: Path, sink: Sink, s: Settings, rows: int, run_id: str) -> Row:
    """One outbox row: `rows` committed at once, drained by one smtpguard process."""
    import psycopg

    from bench.outbox import drain_row
    from smtpguard.outbox.reader import CONCURRENCY

    store = split(scenario)[0].removeprefix("outbox-")
    row = Row(scenario, DRAIN, CONCURRENCY)
    work = tmp / f"{run_id}-{scenario.replace('@', '-w')}"
    work.mkdir()
    try:
        got = drain_row(work, sink, store, rows, s.size, s.pool_size, batch=100, timeout=600)
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, psycopg.Error) as e:
        last = (str(e).strip().splitlines() or [""])[-1]
        row.note = f"FAILED: {last}"[:200]
        row.errors["failed"] = 1
        return row
    row.msgs_s = got["msgs_per_s"]
    row.proxy_cpu_ms_per_msg = got.get("cpu_ms_per_msg")
    row.sent = rows
    row.new_accepted = row.measured = got["sent"]
    row.upstream_received = got["sink_received"]
    row.window_s = got["seconds"]
    row.extra["outbox"] = got
    row.extra["processes"] = 1
    row.note = f"{rows}-row backlog, COMMIT to last receipt {got['seconds']} s, one process"
    if got["sent"] < rows:
        row.errors["not sent"] = rows - got["sent"]
    return row


def verdict_loop(tmp: Path, records: int) -> dict[str, Any]:
    """bench/verdicts.py with every final-dot reply lost, so all `records` events are
    unknown records for the loop to settle (the breaker kept closed: each lost reply counts
    as a provider failure)."""
    from bench.verdicts import run

    work = tmp / "verdicts"
    work.mkdir()
    # The recording upstream's aiosmtpd warns about AUTH without TLS on every session.
    log = logging.getLogger("mail.log")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = asyncio.run(run(records, 1.0, None, tmp=work, breaker_threshold=records + 1))
    finally:
        log.setLevel(level)
    return asdict(report)


def verdict_line(v: dict[str, Any]) -> str:
    settled = sum(v["settled"].values())
    per = v["loop_cpu_ms_per_settled"]
    return (
        f"verdict loop, SQLite store, {v['unknown']} unknown records: {settled} settled "
        f"({', '.join(f'{n} {k}' for k, n in sorted(v['settled'].items())) or 'none'}), "
        f"{v['unsettled']} unsettled, in {v['rounds']} rounds; loop CPU {v['loop_cpu_seconds']:.2f} s = "
        f"{_f(per, 2)} ms per record settled, wall {v['loop_wall_seconds']:.2f} s in the rounds "
        f"({v['wall_seconds']:.1f} s with the sends); upstream copies per event max {v['max_copies']}, "
        f"{v['missing']} missing; {v['api_requests']} log API requests"
    )


def drain_lines(rows: list[Row]) -> list[str]:
    """Each outbox drain beside the same store's SMTP row of the run (no target in the issue)."""
    index = {(r.scenario, r.mode): r for r in rows}
    out = []
    for r in rows:
        if r.mode != DRAIN or r.errors.get("failed"):
            continue
        store = split(r.scenario)[0].removeprefix("outbox-")
        smtp = index.get((f"guard-{store}@1", "unique"))
        vs = ""
        if smtp is not None and smtp.msgs_s > 0 and not smtp.errors.get("failed"):
            vs = f" = {r.msgs_s / smtp.msgs_s:.2f}x guard-{store}@1's SMTP {smtp.msgs_s:.0f} msgs/s"
            if smtp.proxy_cpu_ms_per_msg and r.proxy_cpu_ms_per_msg:
                vs += f"; CPU/msg {r.proxy_cpu_ms_per_msg / smtp.proxy_cpu_ms_per_msg:.2f}x its SMTP's"
        out.append(
            f"  {r.scenario}: {r.msgs_s:.0f} msgs/s, CPU {_f(r.proxy_cpu_ms_per_msg, 2)} ms per message{vs}"
        )
    return out


# --- checks and ratios -----------------------------------------------------------------------
def sink_checks(rows: list[Row]) -> list[tuple[str, bool]]:
    """Per relaying row: what the sink received against the 250s given (0 duplicates, 0 lost)."""
    out: list[tuple[str, bool]] = []
    for r in rows:
        if r.note == NA_WORKERS:
            continue
        if r.errors.get("failed"):
            # Nothing was counted: the run cannot say this row had 0 duplicates and 0 lost.
            out.append((f"{r.scenario:<18} {r.mode:<6}: not counted, {r.note or 'the row failed'}", False))
            continue
        got = r.upstream_received or 0
        if r.scenario == "null":
            out.append((f"{r.scenario:<18} {r.mode:<6}: relays nothing; sink received {got}", got == 0))
            continue
        if r.mode == DRAIN:
            # r.sent: rows committed; r.new_accepted: rows whose receipt says sent.
            dups, lost = max(0, got - r.new_accepted), max(0, r.sent - got)
            out.append(
                (
                    f"{r.scenario:<18} {r.mode:<6}: {r.sent} rows committed, {r.new_accepted} sent, "
                    f"sink received {got} -> {dups} duplicates, {lost} lost",
                    dups == 0 and lost == 0 and r.new_accepted == r.sent,
                )
            )
            continue
        if r.mode == "dup":
            pre_ok = r.predeliver_upstream == r.predelivered
            dups = got - r.new_accepted
            ok = dups == 0 and pre_ok
            out.append(
                (
                    f"{r.scenario:<18} dup   : pre-delivered {r.predelivered} keys "
                    f"(sink +{r.predeliver_upstream}); "
                    f"storm {r.sent} sent, {r.dup_keys_sent} repeats, {r.duplicates_answered} answered "
                    f"'duplicate', {r.new_accepted} new; sink received {got} -> {max(0, dups)} duplicates, "
                    f"{max(0, -dups)} lost",
                    ok,
                )
            )
            continue
        dups, lost = max(0, got - r.new_accepted), max(0, r.new_accepted - got)
        out.append(
            (
                f"{r.scenario:<18} {r.mode:<6}: {r.new_accepted} accepted, sink received {got} -> "
                f"{dups} duplicates, {lost} lost",
                dups == 0 and lost == 0,
            )
        )
    return out


def ratio(index: dict[tuple[str, str], Row], a: str, b: str, mode: str = "unique") -> float | None:
    ra, rb = index.get((a, mode)), index.get((b, mode))
    if ra is None or rb is None or ra.note == NA_WORKERS or rb.note == NA_WORKERS:
        return None
    if ra.errors.get("failed") or rb.errors.get("failed") or rb.msgs_s <= 0:
        return None
    return ra.msgs_s / rb.msgs_s


def paired_ratio(
    rounds: list[list[Row]], a: str, b: str, mode: str = "unique"
) -> tuple[float, list[float]] | None:
    """The median over rounds of a/b measured in the same round: on a shared machine the
    load moves between rounds, and two rows of one round saw the same load."""
    per = [
        x
        for x in (ratio({(r.scenario, r.mode): r for r in rnd}, a, b, mode) for rnd in rounds)
        if x is not None
    ]
    return (statistics.median(per), per) if per else None


def _per_round(rounds: list[list[Row]] | None, scenario: str, attr: str) -> list[float]:
    """`attr` of the unique row of `scenario` in every round that measured it."""
    out = []
    for rnd in rounds or []:
        for r in rnd:
            value = getattr(r, attr)
            if r.scenario == scenario and r.mode == "unique" and not r.errors.get("failed") and value:
                out.append(float(value))
    return out


def targets(rows: list[Row], workers_ok: bool, rounds: list[list[Row]] | None = None) -> list[str]:
    """Issue 30's table, row by row, each with its target and MET / NOT MET. With several
    rounds, a ratio is the median of the per-round ratios (each round's value shown) and a
    CPU figure the median of the rounds' values; else the rows shown."""
    index = {(r.scenario, r.mode): r for r in rows}
    multi = rounds is not None and len(rounds) > 1
    out: list[str] = []

    def met(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    def line(name: str, a: str, b: str, goal: float, na: str = "not measured", mode: str = "unique") -> None:
        value = ratio(index, a, b, mode)
        detail = ""
        if multi:
            got = paired_ratio(rounds or [], a, b, mode)
            if got is not None:
                value = got[0]
                detail = f" (median of rounds {'/'.join(f'{x:.2f}' for x in got[1])})"
        if value is None:
            out.append(f"  {name}: {na}")
            return
        out.append(f"  {name}: {value:.2f}x{detail} (target >= {goal:.2f}x) {met(value >= goal)}")

    def cpu(scenario: str) -> tuple[float, str] | None:
        per = _per_round(rounds, scenario, "proxy_cpu_ms_per_msg") if multi else []
        if per:
            return statistics.median(per), f" (median of rounds {'/'.join(f'{x:.2f}' for x in per)})"
        r = index.get((scenario, "unique"))
        if r is None or r.errors.get("failed") or not r.proxy_cpu_ms_per_msg:
            return None
        return r.proxy_cpu_ms_per_msg, ""

    na = "not measured" if workers_ok else NA_WORKERS
    for store in STORES:
        line(f"guard-{store}@1 / naive @50 unique", f"guard-{store}@1", "naive", NAIVE_GOAL[store])
    naive = cpu("naive")
    for store in STORES:
        name = f"guard-{store}@1 CPU per message @50 unique"
        mine = cpu(f"guard-{store}@1")
        if mine is None:
            out.append(f"  {name}: not measured")
            continue
        goal = CPU_GOAL_MS[store]
        if naive is None:
            out.append(
                f"  {name}: {mine[0]:.2f} ms{mine[1]} (target <= {goal:.2f} ms) {met(mine[0] <= goal)}"
            )
            continue
        # The issue's targets are milliseconds on a machine where the naive relay took
        # ISSUE_NAIVE_CPU_MS; a faster or slower machine moves both, so the target is met
        # when the ratio to this run's naive relay is within the issue's ratio.
        times, goal_times = mine[0] / naive[0], goal / ISSUE_NAIVE_CPU_MS
        out.append(
            f"  {name}: {mine[0]:.2f} ms{mine[1]} = {times:.2f}x naive's {naive[0]:.2f} ms "
            f"(target <= {goal:.2f} ms against naive's {ISSUE_NAIVE_CPU_MS:.2f}: <= {goal_times:.2f}x naive) "
            f"{met(times <= goal_times)}"
        )
    for store in STORES:
        line(
            f"guard-{store}@auto / guard-{store}@1 @50 unique",
            f"guard-{store}@auto",
            f"guard-{store}@1",
            AUTO_GOAL[store],
            na,
        )
    # The best store by its @auto row's msgs/s in the rows shown.
    autos = [
        r
        for r in (index.get((f"guard-{store}@auto", "unique")) for store in STORES)
        if r is not None and r.note != NA_WORKERS and not r.errors.get("failed") and r.msgs_s > 0
    ]
    best = max(autos, key=lambda r: r.msgs_s) if autos else None
    for pf in ("postfix", POSTFIX_TUNED):
        if best is None:
            out.append(f"  best @auto / {pf} @50 unique: {na}")
            continue
        line(f"best @auto ({best.scenario}) / {pf} @50 unique", best.scenario, pf, POSTFIX_GOAL, na)
    tuned = index.get((POSTFIX_TUNED, "unique"))
    if best is None or tuned is None or tuned.errors.get("failed"):
        out.append(f"  best @auto p99 <= {POSTFIX_TUNED} p99 @50 unique: not measured")
    else:
        out.append(
            f"  best @auto ({best.scenario}) p99 {_f(best.p99_ms, 2)} ms vs {POSTFIX_TUNED} p99 "
            f"{_f(tuned.p99_ms, 2)} ms @50 unique (target guard's <= {POSTFIX_TUNED}'s) "
            f"{met(best.p99_ms <= tuned.p99_ms)}"
        )
    for store in STORES:
        for w in WORKERS:
            line(
                f"guard-{store}@{w} dup / null dup @50",
                f"guard-{store}@{w}",
                "null",
                NULL_GOAL,
                na if w != "1" else "not measured",
                mode="dup",
            )
    return out


def table(rows: list[Row]) -> str:
    head = (
        f"{'scenario':<18} {'mode':<6} {'msgs/s':>8} {'p50ms':>8} {'p99ms':>8} {'cpu/msg':>8} "
        f"{'procs':>5} {'RSS MB':>7} {'/naive':>6} {'/postfix':>8} {'/null':>6} {'sink':>10}  note"
    )
    index = {(r.scenario, r.mode): r for r in rows}
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.note == NA_WORKERS:
            lines.append(f"{r.scenario:<18} {r.mode:<6} {NA_WORKERS}")
            continue
        base = r.mode if r.mode == "dup" else "unique"
        sink = "-" if r.upstream_received is None else f"{r.upstream_received}/{r.new_accepted}"
        lines.append(
            f"{r.scenario:<18} {r.mode:<6} {r.msgs_s:>8.0f} {_f(r.p50_ms, 2):>8} {_f(r.p99_ms, 2):>8} "
            f"{_f(r.proxy_cpu_ms_per_msg, 2):>8} {r.extra.get('processes', '-'):>5} {_f(r.rss_mb):>7} "
            f"{_f(ratio(index, r.scenario, 'naive', base), 2):>6} "
            f"{_f(ratio(index, r.scenario, 'postfix', base), 2):>8} "
            f"{_f(ratio(index, r.scenario, 'null', base), 2):>6} {sink:>10}  {r.note}"
        )
    return "\n".join(lines)


# --- chart -----------------------------------------------------------------------------------
def chart(rows: list[Row], path: Path, title: str) -> Path | None:
    """msgs/s and CPU per message by scenario (unique), and the duplicate storm, as one PNG;
    None when matplotlib is not installed (it is optional: `pip install matplotlib`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    unique = [r for r in rows if r.mode == "unique"]
    dup = [r for r in rows if r.mode == "dup"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.45 * max(len(unique), len(dup)) + 2.2))

    def colour(name: str) -> str:
        if name.endswith("@auto"):
            return "#2b8a3e"
        if name.startswith("guard-"):
            return "#1c7ed6"
        return "#868e96"

    def bars(ax: Any, items: list[Row], value: Any, label: str, fmt: str) -> None:
        names = [r.scenario for r in items]
        vals = [0.0 if r.note == NA_WORKERS or value(r) is None else float(value(r)) for r in items]
        ys = list(range(len(items)))[::-1]
        ax.barh(ys, vals, color=[colour(n) for n in names])
        ax.set_yticks(ys, names)
        ax.set_xlabel(label)
        top = max(vals) if vals and max(vals) > 0 else 1.0
        for y, v, r in zip(ys, vals, items, strict=True):
            text = "n/a" if r.note == NA_WORKERS else fmt.format(v)
            ax.text(v + top * 0.01, y, text, va="center", fontsize=8)
        ax.set_xlim(0, top * 1.18)

    bars(axes[0], unique, lambda r: r.msgs_s, "msgs/s, unique events (50 sessions)", "{:.0f}")
    bars(axes[1], unique, lambda r: r.proxy_cpu_ms_per_msg, "CPU ms per message (all processes)", "{:.2f}")
    bars(axes[2], dup, lambda r: r.msgs_s, "msgs/s, duplicate storm (90% repeats)", "{:.0f}")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cores", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 s per measurement, one round (~2 min)")
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--duration", type=float, help="seconds measured per row (default 3, quick 1)")
    ap.add_argument("--warmup", type=float, help="seconds of warm-up per row (default 0.5, quick 0.3)")
    ap.add_argument(
        "--repeat", type=int, default=1, help="interleaved rounds; each row shows its median round"
    )
    ap.add_argument("--pool-size", type=int, default=8)
    ap.add_argument("--size", type=int, default=2000)
    ap.add_argument("--no-postfix", action="store_true", help="neither Postfix row")
    ap.add_argument("--outbox-rows", type=int, help="outbox backlog per store (default 10,000, quick 2,000)")
    ap.add_argument("--no-outbox", action="store_true")
    ap.add_argument("--verdict-records", type=int, default=1000, help="unknown records for the verdict loop")
    ap.add_argument("--no-verdicts", action="store_true")
    ap.add_argument("--chart", type=Path, help="also copy the PNG here")
    ap.add_argument("--keep-tmp", action="store_true")
    args = ap.parse_args(argv)
    install_sigterm()
    s = Settings(
        warmup=args.warmup if args.warmup is not None else (0.3 if args.quick else 0.5),
        duration=args.duration if args.duration is not None else (1.0 if args.quick else 3.0),
        max_messages=100_000,
        size=args.size,
        dup_keys=200 if args.quick else 500,
        dup_ratio=0.9,
        paced_rate=50.0,
        pool_size=args.pool_size,
        pipelining=False,
    )
    stores = tuple(x for x in args.stores.split(",") if x)
    postfixes = [] if args.no_postfix else ["postfix", POSTFIX_TUNED]
    scenarios = ["null", "naive", *postfixes, *guard_scenarios(stores)]
    drains = [] if args.no_outbox else [f"outbox-{store}@1" for store in stores]
    outbox_rows = args.outbox_rows or (2_000 if args.quick else 10_000)
    verdicts: dict[str, Any] | None = None
    run_id = stamp()
    git_at_start = git_state()
    password_hash()
    started = time.monotonic()
    all_rows: list[Row] = []
    skipped: dict[str, str] = {}
    with workdir("smtpguard-bench-cores-", keep=args.keep_tmp) as tmp:
        workers_ok, why = workers_supported(tmp)
        if not workers_ok:
            print(f"workers: auto refused by this smtpguard ({why}): @auto rows are n/a", flush=True)
        sink = Sink(tmp)
        print(f"sink: {sink.kind} on 127.0.0.1:{sink.port}; {os.cpu_count()} cores; tmp {tmp}", flush=True)
        try:
            for rnd in range(args.repeat):
                if args.repeat > 1:
                    print(f"--- round {rnd + 1}/{args.repeat}", flush=True)
                for scenario in [*scenarios, *drains]:
                    workers = split(scenario)[1]
                    reason = scenario_reason(scenario)
                    if reason:
                        skipped[scenario] = reason
                        if rnd == 0:
                            print(f"skip {scenario}: {reason}", flush=True)
                        continue
                    for mode in modes_for(scenario):
                        if workers not in (None, "1") and not workers_ok:
                            all_rows.append(Row(scenario, mode, args.sessions, note=NA_WORKERS))
                            continue
                        t0 = time.monotonic()
                        if mode == DRAIN:
                            row = measure_drain(scenario, tmp, sink, s, outbox_rows, f"{run_id}r{rnd}")
                        elif scenario == POSTFIX_TUNED:
                            row = measure_postfix_tuned(tmp, sink, s, args.sessions, f"{run_id}r{rnd}")
                        else:
                            row = measure_retrying(
                                scenario, mode, args.sessions, tmp, sink, s, f"{run_id}r{rnd}", start
                            )
                        row.extra["round"] = rnd
                        all_rows.append(row)
                        print(
                            f"{scenario:<18} {mode:<6}: {row.msgs_s:8.0f} msgs/s  p50 {_f(row.p50_ms, 2)} "
                            f"p99 {_f(row.p99_ms, 2)} ms  cpu/msg {_f(row.proxy_cpu_ms_per_msg, 2)} ms  "
                            f"sink {row.upstream_received}/{row.new_accepted}  "
                            f"errors {dict(row.errors) or 0}  "
                            f"({time.monotonic() - t0:.1f}s)",
                            flush=True,
                        )
            if not args.no_verdicts:
                t0 = time.monotonic()
                verdicts = verdict_loop(tmp, args.verdict_records)
                print(f"{verdict_line(verdicts)} ({time.monotonic() - t0:.1f}s)", flush=True)
        finally:
            sink.stop()
    rows = medians([r for r in all_rows if r.note != NA_WORKERS])
    na_rows = {(r.scenario, r.mode): r for r in all_rows if r.note == NA_WORKERS}
    order = {
        (sc, m): i for i, (sc, m) in enumerate((sc, m) for sc in [*scenarios, *drains] for m in modes_for(sc))
    }
    rows = sorted([*rows, *na_rows.values()], key=lambda r: order.get((r.scenario, r.mode), 999))
    print()
    print(table(rows))
    print("\nCounted at the sink (every relaying row: 0 duplicates, 0 lost):")
    checks = sink_checks(all_rows)
    for text, ok in checks:
        print(f"  {text}: {'OK' if ok else 'FAIL'}")
    print("Outbox drain, one process per store (same run):")
    for t in drain_lines(rows) or ["  not measured"]:
        print(t)
    if verdicts is not None:
        print(verdict_line(verdicts))
    print("Issue 30's table (50 sessions, same run):")
    by_round = [[r for r in all_rows if r.extra.get("round") == rnd] for rnd in range(args.repeat)]
    tl = targets(rows, workers_ok, by_round)
    for t in tl:
        print(t)
    load = os.getloadavg()[0]
    print(
        f"\nnotes: {os.cpu_count()} cores; {s.duration:g} s measured after {s.warmup:g} s warm-up per row, "
        f"{args.repeat} round(s); postfix sends without AUTH; redis-server without fsync; PostgreSQL with "
        f"fsync; upstream pool {s.pool_size}; outbox {outbox_rows} rows per store and round; verdict loop "
        f"once per run; load avg now {load:.2f}"
    )
    payload: dict[str, Any] = {
        "run_id": run_id,
        "command": " ".join(["bench.cores", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "git": git_state(),
        "git_at_start": git_at_start,
        "settings": asdict(s),
        "workers_supported": workers_ok,
        "workers_probe": why,
        "skipped": skipped,
        "elapsed_s": round(time.monotonic() - started, 1),
        "rows": [asdict(r) for r in rows],
        "all_rounds": [asdict(r) for r in all_rows] if args.repeat > 1 else None,
        "sink_checks": [{"check": t, "ok": ok} for t, ok in checks],
        "targets": tl,
        "verdicts": verdicts,
    }
    path = write_result("cores", payload)
    print(f"\nwrote {path.relative_to(ROOT)}")
    title = (
        f"bench.cores {run_id}: {os.cpu_count()} cores, {args.sessions} sessions, "
        f"{s.duration:g} s per row, median of {args.repeat}"
    )
    png = chart(rows, path.with_suffix(".png"), title)
    if png is None:
        print("no chart: matplotlib is not installed (pip install matplotlib)")
    else:
        print(f"wrote {png.relative_to(ROOT)}")
        if args.chart is not None:
            args.chart.write_bytes(png.read_bytes())
            print(f"copied to {args.chart}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
