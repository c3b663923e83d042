"""Sequences the stateful ledger search found, replayed step by step on every store, with
the invariants checked after each step as the search checks them.

Units (DESIGN.md §11.3). Two instances share the store; b's next consume_cap is written but
its reply is lost; a is reloaded with acme in queue mode, then killed right after it accepted
acme/k1 into the lane; b's worker takes the entry and stalls for longer than the lease while
a's fresh process runs its own worker, which takes the entry over (refunding b's token, not
yet spent) and delivers it; then b carries on and asks for its unit, which is written with
the reply lost. Checked after every step and at the end (§11.3): the units acme consumed stay
within the DATA commands the upstream saw for it — the defect left 2 units for 1 DATA
command, on every store.

Errors before DATA (§11.6). b relays auto/b0, which leaves a connection in its pool; a is
reloaded to queue acme, b to relay it; a is killed right after it accepted acme/k1 into the
lane; b's worker takes the entry, writes its data_sent mark and stalls for longer than the
lease while a's fresh process runs its worker, which finds the lease gone after the mark and
holds the event `unknown` for b to report on. b carries on: its pooled connection closes at
the DATA command, before any 354, and so does the fresh one it asks next. Nothing of the
message went out, and b says so: the event is retryable, not `unknown`. The defect wrote
the mark a second time for the fresh connection; that write lost to a's takeover, b gave up
with `lease_lost` and reported nothing, and the event stayed `unknown` with no dot sent, on
every store (the search found it on Redis and PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from tests.invariants.test_stateful import (
    MESSAGES,
    Backend,
    Harness,
    LedgerMachine,
    PostgresBackend,
    RedisBackend,
    Setup,
    SqliteBackend,
    machine_for,
)

Steps = Callable[[LedgerMachine], None]


def _replay(backend: Backend, run: Steps) -> None:
    """The steps in order, inside one explicit Hypothesis example: the machine's notes then
    print with a failure as the search prints them."""

    @settings(phases=(Phase.explicit,), deadline=None, database=None)
    @given(st.none())
    @example(None)
    def steps(_: None) -> None:
        _run_steps(backend, run)

    steps()


def _run_steps(backend: Backend, run: Steps) -> None:
    harness = Harness(backend)
    try:
        machine = machine_for(harness)()
        try:
            run(machine)
        finally:
            machine.teardown()
    finally:
        harness.close()


def _lost_consume_reply_then_stall(machine: LedgerMachine) -> None:
    machine.start(Setup(acme="relay", auto="relay", caps="tiny", windows="short"))
    machine.ledger_invariants()
    machine.store_fault(slot="b", method="consume_cap", mode="after")
    machine.ledger_invariants()
    machine.reload(which="a", setup=Setup(acme="queue", caps="tiny", windows="short"))
    machine.ledger_invariants()
    machine.crash_during_submit(slot="a", msg=MESSAGES[0], cls=None, phase="reserved")
    machine.ledger_invariants()
    machine.stall_during_delivery(slot="b", phase="taken", seconds=7.0, then="other_worker")
    machine.ledger_invariants()


def _pooled_drop_at_data_after_a_lost_lease(machine: LedgerMachine) -> None:
    auto_b0 = next(m for m in MESSAGES if m.zone == "auto")
    machine.start(Setup(acme="relay", auto="relay", caps="tiny", windows="short"))
    machine.ledger_invariants()
    machine.submit(slot="b", msg=auto_b0, cls=None, behaviour="ok")
    machine.ledger_invariants()
    machine.reload(which="a", setup=Setup(acme="queue", caps="tiny", windows="short"))
    machine.ledger_invariants()
    machine.reload(which="b", setup=Setup(acme="relay", caps="tiny", windows="short"))
    machine.ledger_invariants()
    machine.worker_pass(slot="a", behaviour="drop_before_data")
    machine.ledger_invariants()
    machine.crash_during_submit(slot="a", msg=MESSAGES[0], cls=None, phase="reserved")
    machine.ledger_invariants()
    machine.stall_during_delivery(slot="b", phase="after_mark", seconds=7.0, then="other_worker")
    machine.ledger_invariants()


def _backend(store: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if store == "sqlite":
        return SqliteBackend(tmp_path)
    if store == "redis":
        return RedisBackend(request.getfixturevalue("redis_server"))
    return PostgresBackend(request.getfixturevalue("postgres_server"))


STORES = pytest.mark.parametrize("store", ["sqlite", "redis", "postgres"])


@STORES
def test_units_lost_consume_reply_then_stall(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    _replay(_backend(store, request, tmp_path), _lost_consume_reply_then_stall)


@STORES
def test_errors_before_data_pooled_drop_at_data_after_a_lost_lease(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    _replay(_backend(store, request, tmp_path), _pooled_drop_at_data_after_a_lost_lease)
