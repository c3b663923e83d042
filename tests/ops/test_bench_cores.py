"""bench/cores.py's bookkeeping: the sink check that must flag every duplicate and every lost
message, and the ratios that must say n/a rather than a number when a build has no workers."""

from __future__ import annotations

from bench.cores import NA_WORKERS, modes_for, ratio, sink_checks, split, targets
from bench.relay import Row


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
    assert "  guard-redis@1 / naive @50 unique: 0.80x (target 0.80x) MET" in lines
    assert "  guard-redis@1 dup / null dup @50: 0.90x (target 0.80x) MET" in lines


def test_a_row_that_failed_is_a_failed_check_not_a_silent_pass() -> None:
    failed = Row("guard-redis@auto", "unique", 50, note="FAILED: smtpguard did not listen")
    failed.errors["failed"] = 1
    checks = sink_checks([_row("naive", "unique", 600, 300, 300), failed])
    assert [ok for _, ok in checks] == [True, False]
    assert "not counted, FAILED: smtpguard did not listen" in checks[1][0]
