"""A sequence the stateful ledger search found (DESIGN.md §11.3, units), replayed step by
step on every store, with the invariants checked after each step as the search checks them.

Two instances share the store; b's next consume_cap is written but its reply is lost; a is
reloaded with acme in queue mode, then killed right after it accepted acme/k1 into the lane;
b's worker takes the entry and stalls for longer than the lease while a's fresh process runs
its own worker, which takes the entry over (refunding b's token, not yet spent) and delivers
it; then b carries on and asks for its unit, which is written with the reply lost. Checked
after every step and at the end (§11.3): the units acme consumed stay within the DATA commands
the upstream saw for it — the defect left 2 units for 1 DATA command, on every store.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from tests.invariants.test_stateful import (
    MESSAGES,
    Backend,
    Harness,
    PostgresBackend,
    RedisBackend,
    Setup,
    SqliteBackend,
    machine_for,
)


def _replay(backend: Backend) -> None:
    """The steps in order, inside one explicit Hypothesis example: the machine's notes then
    print with a failure as the search prints them."""

    @settings(phases=(Phase.explicit,), deadline=None, database=None)
    @given(st.none())
    @example(None)
    def steps(_: None) -> None:
        _run_steps(backend)

    steps()


def _run_steps(backend: Backend) -> None:
    harness = Harness(backend)
    try:
        machine = machine_for(harness)()
        try:
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
        finally:
            machine.teardown()
    finally:
        harness.close()


@pytest.mark.parametrize("store", ["sqlite", "redis", "postgres"])
def test_units_lost_consume_reply_then_stall(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    backend: Backend
    if store == "sqlite":
        backend = SqliteBackend(tmp_path)
    elif store == "redis":
        backend = RedisBackend(request.getfixturevalue("redis_server"))
    else:
        backend = PostgresBackend(request.getfixturevalue("postgres_server"))
    _replay(backend)
