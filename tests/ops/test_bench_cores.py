"""bench/cores.py's bookkeeping: the sink check that must flag every duplicate and every lost
message, and the ratios that must say n/a rather than a number when a build has no workers."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import pytest

from bench.client import deliver_keys
from bench.common import Postfix, Sink, workdir
from bench.cores import (
    DRAIN,
    NA_WORKERS,
    drain_lines,
    measure_drain,
    modes_for,
    ratio,
    scenario_reason,
    sink_checks,
    split,
    targets,
    verdict_line,
    verdict_loop,
)
from bench.relay import Row, Settings


def _row(scenario: str, mode: str, msgs_s: float, accepted: int, received: int, **kw: object) -> Row:
    r = Row(scenario, mode, 50, msgs_s=msgs_s, new_accepted=accepted, upstream_received=received)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_scenario_names_and_modes() -> None:
    assert split("guard-redis@auto") == ("guard-redis", "auto")
    assert split("naive") == ("naive", None)
    assert modes_for("null") == ("dup",)
    assert modes_for("postfix") == ("unique",)
    assert modes_for("guard-sqlite@1") == ("unique", "dup")
    assert modes_for("postfix-tuned") == ("unique",)
    assert modes_for("outbox-redis@1") == (DRAIN,)
    assert scenario_reason("outbox-sqlite@1") == scenario_reason("guard-postgres")


def test_redis_rows_run_where_redis_server_is_installed() -> None:
    # The Redis store is the package smtpguard/store/redis/, not a module file.
    want = None if shutil.which("redis-server") else "redis-server is not installed"
    assert scenario_reason("guard-redis@1") == want
    assert scenario_reason("guard-redis@auto") == want
    assert scenario_reason("outbox-redis@1") in (want, scenario_reason("guard-postgres"))


def test_sink_check_counts_duplicates_and_lost() -> None:
    rows = [
        _row("naive", "unique", 600, 300, 300),
        _row("guard-sqlite@1", "unique", 500, 250, 251),  # one message twice upstream
        _row("guard-redis@1", "unique", 500, 250, 249),  # one accepted message never arrived
        _row("guard-redis@1", "dup", 900, 40, 40, predelivered=200, predeliver_upstream=200),
        _row("guard-sqlite@1", "dup", 900, 40, 41, predelivered=200, predeliver_upstream=200),
        _row("null", "dup", 1000, 0, 0),
        Row("guard-redis@auto", "unique", 50, note=NA_WORKERS),
    ]
    checks = sink_checks(rows)
    assert [ok for _, ok in checks] == [True, False, False, True, False, True]
    assert "1 duplicates, 0 lost" in checks[1][0]
    assert "0 duplicates, 1 lost" in checks[2][0]
    assert "1 duplicates" in checks[4][0]


def test_ratios_and_targets_without_workers() -> None:
    rows = [
        _row("naive", "unique", 800, 0, 0),
        _row("postfix", "unique", 500, 0, 0),
        _row("null", "dup", 1000, 0, 0),
        _row("guard-redis@1", "unique", 640, 0, 0),
        _row("guard-redis@1", "dup", 900, 0, 0),
        Row("guard-redis@auto", "unique", 50, note=NA_WORKERS),
    ]
    index = {(r.scenario, r.mode): r for r in rows}
    assert ratio(index, "guard-redis@1", "naive") == 0.8
    assert ratio(index, "guard-redis@auto", "guard-redis@1") is None
    lines = targets(rows, workers_ok=False)
    assert "  guard-redis@auto / guard-redis@1 @50 unique: " + NA_WORKERS in lines
    assert "  guard-redis@1 / naive @50 unique: 0.80x (target >= 0.80x) MET" in lines
    assert "  guard-redis@1 dup / null dup @50: 0.90x (target >= 0.90x) MET" in lines
    assert "  best @auto / postfix-tuned @50 unique: " + NA_WORKERS in lines


def test_a_row_that_failed_is_a_failed_check_not_a_silent_pass() -> None:
    failed = Row("guard-redis@auto", "unique", 50, note="FAILED: smtpguard did not listen")
    failed.errors["failed"] = 1
    checks = sink_checks([_row("naive", "unique", 600, 300, 300), failed])
    assert [ok for _, ok in checks] == [True, False]
    assert "not counted, FAILED: smtpguard did not listen" in checks[1][0]


def _issue_rows(tuned_p99: float) -> list[Row]:
    rows = [
        _row("naive", "unique", 1000, 0, 0, proxy_cpu_ms_per_msg=1.5),
        _row("postfix", "unique", 500, 0, 0),
        _row("postfix-tuned", "unique", 600, 0, 0, p99_ms=tuned_p99),
        _row("null", "dup", 2000, 0, 0),
    ]
    for store, one, auto, cpu in (
        ("sqlite", 800, 900, 1.8),
        ("redis", 700, 1120, 2.0),
        ("postgres", 500, 600, 2.4),
    ):
        rows.append(_row(f"guard-{store}@1", "unique", one, 0, 0, proxy_cpu_ms_per_msg=cpu))
        rows.append(_row(f"guard-{store}@auto", "unique", auto, 0, 0, p99_ms=40.0))
    return rows


def test_issue_table_has_every_target_with_its_verdict() -> None:
    lines = targets(_issue_rows(tuned_p99=50.0), workers_ok=True)
    assert "  guard-sqlite@1 / naive @50 unique: 0.80x (target >= 0.80x) MET" in lines
    assert "  guard-postgres@1 / naive @50 unique: 0.50x (target >= 0.65x) NOT MET" in lines
    assert (
        "  guard-sqlite@1 CPU per message @50 unique: 1.80 ms = 1.20x naive's 1.50 ms "
        "(target <= 1.90 ms against naive's 1.54: <= 1.23x naive) MET"
    ) in lines
    # 2.0 ms is below 1.9 ms nowhere, and 1.33x naive is above the issue's 1.23x.
    assert any(
        x.startswith("  guard-redis@1 CPU per message") and x.endswith("<= 1.23x naive) NOT MET")
        for x in lines
    )
    # Judged by the ratio, not the milliseconds: on a machine twice as fast, 1.0 ms is not a pass.
    fast = _issue_rows(tuned_p99=50.0)
    for r in fast:
        if r.scenario == "naive":
            r.proxy_cpu_ms_per_msg = 0.75
        if r.scenario == "guard-sqlite@1":
            r.proxy_cpu_ms_per_msg = 1.0
    quick = targets(fast, workers_ok=True)
    assert any(x.startswith("  guard-sqlite@1 CPU per message @50 unique: 1.00 ms = 1.33x") for x in quick)
    assert any(x.startswith("  guard-sqlite@1 CPU per message") and x.endswith("NOT MET") for x in quick)
    assert "  guard-sqlite@auto / guard-sqlite@1 @50 unique: 1.12x (target >= 1.20x) NOT MET" in lines
    assert "  guard-redis@auto / guard-redis@1 @50 unique: 1.60x (target >= 1.40x) MET" in lines
    # the best @auto row is redis's (1,120 msgs/s), against both Postfix rows
    assert "  best @auto (guard-redis@auto) / postfix @50 unique: 2.24x (target >= 1.80x) MET" in lines
    assert "  best @auto (guard-redis@auto) / postfix-tuned @50 unique: 1.87x (target >= 1.80x) MET" in lines
    assert (
        "  best @auto (guard-redis@auto) p99 40.00 ms vs postfix-tuned p99 50.00 ms @50 unique "
        "(target guard's <= postfix-tuned's) MET"
    ) in lines
    slower = targets(_issue_rows(tuned_p99=30.0), workers_ok=True)
    assert any("p99 40.00 ms vs postfix-tuned p99 30.00 ms" in x and x.endswith("NOT MET") for x in slower)
    assert "  guard-postgres@auto dup / null dup @50: not measured" in lines


def test_issue_table_takes_the_median_of_rounds() -> None:
    rounds = [_issue_rows(50.0), _issue_rows(50.0), _issue_rows(50.0)]
    for rnd, cpu in zip(rounds, (1.7, 2.2, 1.8), strict=True):
        next(r for r in rnd if r.scenario == "guard-sqlite@1").proxy_cpu_ms_per_msg = cpu
    lines = targets(rounds[0], workers_ok=True, rounds=rounds)
    assert any(
        x.startswith("  guard-sqlite@1 CPU per message @50 unique: 1.80 ms (median of rounds 1.70/2.20/1.80)")
        and x.endswith("MET")
        for x in lines
    )


def test_a_drain_row_is_checked_against_the_rows_committed() -> None:
    whole = _row("outbox-sqlite@1", DRAIN, 400, 1000, 1000, sent=1000)
    short = _row("outbox-redis@1", DRAIN, 400, 990, 990, sent=1000)  # 10 rows never sent
    twice = _row("outbox-postgres@1", DRAIN, 400, 1000, 1001, sent=1000)
    checks = sink_checks([whole, short, twice])
    assert [ok for _, ok in checks] == [True, False, False]
    assert "1000 rows committed, 990 sent, sink received 990 -> 0 duplicates, 10 lost" in checks[1][0]
    assert "1 duplicates, 0 lost" in checks[2][0]


def _settings() -> Settings:
    return Settings(0.3, 1.0, 100_000, 2000, 200, 0.9, 50.0, 8, False)


@pytest.mark.parametrize("store", ["sqlite", "redis", "postgres"])
def test_outbox_drain_row_counts_every_row_at_the_sink(tmp_path: Path, store: str) -> None:
    reason = scenario_reason(f"outbox-{store}@1")
    if reason:
        pytest.skip(reason)
    tmp_path.chmod(0o755)
    sink = Sink(tmp_path)
    try:
        row = measure_drain(f"outbox-{store}@1", tmp_path, sink, _settings(), 60, "t")
    finally:
        sink.stop()
    assert not row.errors, row.note
    assert (row.sent, row.new_accepted, row.upstream_received) == (60, 60, 60)
    assert row.msgs_s > 0 and row.proxy_cpu_ms_per_msg is not None and row.proxy_cpu_ms_per_msg > 0
    assert [ok for _, ok in sink_checks([row])] == [True]
    smtp = _row(
        f"guard-{store}@1", "unique", row.msgs_s / 2, 0, 0, proxy_cpu_ms_per_msg=row.proxy_cpu_ms_per_msg
    )
    assert drain_lines([smtp, row])[0].endswith(
        f"= 2.00x guard-{store}@1's SMTP {row.msgs_s / 2:.0f} msgs/s; CPU/msg 1.00x its SMTP's"
    )


def test_verdict_loop_settles_every_unknown_record(tmp_path: Path) -> None:
    v = verdict_loop(tmp_path, 20)
    assert v["unknown"] == 20 and v["settled"] == {"delivered": 20} and v["unsettled"] == 0
    assert v["max_copies"] == 1 and v["missing"] == 0  # the upstream got each event once
    assert v["loop_cpu_seconds"] > 0 and v["loop_wall_seconds"] > 0
    assert math.isclose(v["loop_cpu_ms_per_settled"], 1000 * v["loop_cpu_seconds"] / 20, rel_tol=0.01)
    assert verdict_line(v).startswith(
        "verdict loop, SQLite store, 20 unknown records: 20 settled (20 delivered)"
    )


def test_tuned_postfix_relays_everything_over_cached_connections() -> None:
    reason = scenario_reason("postfix-tuned")
    if reason or shutil.which("postconf") is None:
        pytest.skip(reason or "postconf is not installed")
    # Postfix's daemons (user postfix) must reach the queue: pytest's tmp_path is private.
    with workdir("smtpguard-test-postfix-") as tmp:
        sink = Sink(tmp)
        try:
            pf = Postfix(tmp / "row", sink.port, tuned=True)
            try:
                res = asyncio.run(deliver_keys(pf.port, [f"k{i}" for i in range(100)], 10, False, 2000))
                assert res.new_accepted == 100 and not res.errors
                assert sink.wait_for(100, 60)
                assert sink.settled_count(quiet=1.0) == 100
            finally:
                pf.stop()
            log = (tmp / "row" / "postfix" / "maillog").read_text()
            main_cf = (tmp / "row" / "postfix" / "conf" / "main.cf").read_text()
        finally:
            sink.stop()
    # conn_use=N: the delivery went over a connection already used N-1 times
    assert sum("conn_use=" in line for line in log.splitlines()) > 0
    assert "in_flow_delay = 0" in main_cf
