"""The queue gate (DESIGN.md §4a, §16): a claimed entry is held, unsent, by the first of
zone pause → class pause → throttle → caps that applies, each for its own time; else it goes.

Through the real worker: a guard on a fake clock with a real SQLite store and a recording
upstream; each case reads the due time the held entry was given back with, and counts what
the upstream received."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from smtpguard.class_pauses import HOLD as CLASS_HOLD
from smtpguard.policy.limits import CapReached
from smtpguard.policy.queue import (
    GO,
    HOLD_MONTH_CAPPED,
    HOLD_PAUSED,
    HOLD_ZONE_GONE,
    GateFacts,
    Go,
    Hold,
    Look,
    gate,
)
from smtpguard.store import QueueEntry
from smtpguard.store.base import Store
from tests.queue.test_queue import queue_config
from tests.support import FakeClock, Upstream, message, running_guard, send
from tests.support.eventually import eventually

HOUR = 3600.0


async def _held(store: Store, key: str, accepted_at: float) -> QueueEntry:
    """The entry once the worker has given it back (its due time moved past acceptance)."""

    async def entry() -> QueueEntry | None:
        return {e.key: e for e in await store.queue_entries("acme")}.get(key)

    def held(e: QueueEntry | None) -> bool:
        return e is not None and not e.claimed and e.due_at is not None and e.due_at > accepted_at

    # The worker claims within its 100 ms poll.
    found = await eventually(entry, held, timeout=3, interval=0.03)
    assert found is not None and held(found), f"{key} was never held: {found}"
    return found


CASES: dict[str, tuple[dict[str, Any], str, float]] = {
    # name: (setup, class header, expected hold from now)
    "zone paused in config": ({"config_paused": True}, "transactional", 1.0),
    "zone paused in the store": ({"store_paused": True}, "transactional", 1.0),
    "class paused": ({"class_paused": "transactional"}, "transactional", CLASS_HOLD),
    "class paused, held no longer than max_age": ({"class_paused": "otp"}, "otp", 2.0),
    "zone pause before class pause": ({"store_paused": True, "class_paused": "bulk"}, "bulk", 1.0),
    "capped": ({"cap": 0}, "transactional", HOUR),
    "zone pause before caps": ({"store_paused": True, "cap": 0}, "transactional", 1.0),
    "class pause before caps": ({"class_paused": "bulk", "cap": 0}, "bulk", CLASS_HOLD),
}


@pytest.mark.parametrize("name", list(CASES))
async def test_the_first_rung_that_applies_holds_the_entry_for_its_time(
    name: str, tmp: Path, upstream: Upstream
) -> None:
    setup, cls, hold = CASES[name]
    overrides: dict[str, Any] = {}
    if setup.get("config_paused"):
        overrides["zones__acme__paused"] = True
    if "cap" in setup:
        overrides["zones__acme__hourly_cap"] = setup["cap"]
    cfg = queue_config(tmp, upstream.port, **overrides)
    clock = FakeClock()
    async with running_guard(cfg, clock=clock) as guard:
        store = guard.store
        assert store is not None
        if setup.get("store_paused"):
            await store.set_paused("acme", True)
        if "class_paused" in setup:
            await store.set_class_paused("acme", setup["class_paused"], True)
        reply = await send(guard.ports[0], message(f"gate:{cls}", headers={"X-Message-Class": cls}))
        assert reply.code == 250, str(reply)
        entry = await _held(store, f"gate:{cls}", clock.t)
    assert entry.due_at is not None
    print(f"queue gate, {name}: held {entry.due_at - clock.t:.3f} s; upstream {len(upstream.received)}")
    assert entry.due_at == pytest.approx(clock.t + hold, abs=0.002)
    assert upstream.received == []


async def test_an_entry_no_rung_holds_is_delivered_once(tmp: Path, upstream: Upstream) -> None:
    cfg = queue_config(tmp, upstream.port)
    async with running_guard(cfg, clock=FakeClock()) as guard:
        store = guard.store
        assert store is not None
        assert (await send(guard.ports[0], message("gate:go"))).code == 250
        await upstream.wait_received(1)
        # Settled and out of the queue: nothing is left that a worker could claim again.
        left = await eventually(
            lambda: store.queue_entries("acme"), lambda es: es == [], timeout=3, interval=0.02
        )
        assert left == []
        # A message accepted after it is delivered: the worker has claimed again since.
        assert (await send(guard.ports[0], message("gate:after"))).code == 250
        await upstream.wait_received(2)
    assert upstream.event_keys() == ["gate:go", "gate:after"]


# --- the pure gate (policy/queue.py) -----------------------------------------------------------
NOW = 1_800_000_000.0
FREE = GateFacts(NOW, None, True, CLASS_HOLD, False, False, True, None, True, None)


def _asks(facts: GateFacts, answers: dict[Look, dict[str, Any]]) -> tuple[list[Look], Go | Hold]:
    """Run the gate as the worker does, answering each look from `answers` (else: free)."""
    free = {
        Look.PAUSE: {"paused": False},
        Look.CLASS: {"class_paused": False},
        Look.THROTTLE: {"throttle_looked": True},
        Look.CAP: {"cap_looked": True},
    }
    asked: list[Look] = []
    for _ in range(len(Look) + 1):
        step = gate(facts)
        if not isinstance(step, Look):
            return asked, step
        asked.append(step)
        facts = replace(facts, **answers.get(step, free[step]))
    raise AssertionError(f"the gate kept asking: {asked}")


def test_the_gate_asks_pause_class_throttle_cap_in_that_order_then_goes() -> None:
    asked, verdict = _asks(GateFacts(NOW, None, True, CLASS_HOLD), {})
    assert asked == [Look.PAUSE, Look.CLASS, Look.THROTTLE, Look.CAP]
    assert verdict == GO and gate(FREE) == GO


@pytest.mark.parametrize(
    ("answers", "asked", "held"),
    [
        ({Look.PAUSE: {"paused": True}}, [Look.PAUSE], Hold(NOW + HOLD_PAUSED, "paused")),
        (
            {Look.CLASS: {"class_paused": True}},
            [Look.PAUSE, Look.CLASS],
            Hold(NOW + CLASS_HOLD, "class_paused"),
        ),
        (
            {Look.THROTTLE: {"throttle_looked": True, "throttled_until": NOW + 7}},
            [Look.PAUSE, Look.CLASS, Look.THROTTLE],
            Hold(NOW + 7, "throttled"),
        ),
        (
            {Look.CAP: {"cap_looked": True, "cap": CapReached("hour", 5, free_at=NOW + 90)}},
            list(Look),
            Hold(NOW + 90, "capped"),
        ),
        (
            {Look.CAP: {"cap_looked": True, "cap": CapReached("month", 5)}},
            list(Look),
            Hold(NOW + HOLD_MONTH_CAPPED, "capped"),
        ),
        (
            # Every rung would hold: the first one does, and nothing after it is looked at
            # (above all the cap, whose look spends a unit).
            {
                Look.PAUSE: {"paused": True},
                Look.CLASS: {"class_paused": True},
                Look.CAP: {"cap_looked": True, "cap": CapReached("hour", 0, free_at=NOW + 1)},
            },
            [Look.PAUSE],
            Hold(NOW + HOLD_PAUSED, "paused"),
        ),
    ],
)
def test_the_first_rung_that_holds_ends_the_looks(
    answers: dict[Look, dict[str, Any]], asked: list[Look], held: Hold
) -> None:
    assert _asks(GateFacts(NOW, None, True, CLASS_HOLD), answers) == (asked, held)


def test_a_zone_that_is_gone_is_held_before_anything_is_looked_at() -> None:
    assert _asks(GateFacts(NOW, None, False, CLASS_HOLD), {}) == ([], Hold(NOW + HOLD_ZONE_GONE, "zone_gone"))


def test_a_paused_class_holds_no_longer_than_the_entry_may_live() -> None:
    paused = replace(FREE, class_paused=True)
    assert gate(replace(paused, expires_at=NOW + 2)) == Hold(NOW + 2, "class_paused")
    assert gate(replace(paused, expires_at=NOW + 3600)) == Hold(NOW + CLASS_HOLD, "class_paused")
