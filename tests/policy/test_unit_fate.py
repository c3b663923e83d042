"""The fate of a cap unit (DESIGN.md §5, §11.3): an attempt's unit is spent once anything may
have reached a provider's DATA, and given back when nothing can have (refused at MAIL or RCPT,
no provider reachable, stopped before DATA).

Through the real listener and a recording upstream on a real SQLite store: each case reads
the units the store holds after one submission's outcome, and counts the DATA commands the
upstream saw."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from smtpguard.policy.limits import Ending, month_of, unit_fate
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.server import Server
from tests.support import Behaviour, Upstream, base_config, free_port, message, running_guard, send


async def _units(guard: Server) -> tuple[int, int]:
    assert guard.store is not None
    now = guard.clock()
    usage = await guard.store.cap_usage("acme", now, month_of(now))
    return usage.hour, usage.month


CASES: dict[str, tuple[Behaviour, int, int]] = {
    # name: (upstream behaviour, reply code, units held after)
    "delivered": (Behaviour(), 250, 1),
    "refused at MAIL (deferred before DATA)": (Behaviour(mail="451 4.3.0 try later"), 451, 0),
    "refused at RCPT": (Behaviour(rcpt={"customer@example.com": "550 5.1.1 no such user"}), 550, 0),
    "deferred after DATA": (Behaviour(data="451 4.3.0 try later"), 451, 1),
    "failed after DATA": (Behaviour(data="554 5.6.0 rejected"), 554, 1),
}


@pytest.mark.parametrize("name", list(CASES))
async def test_a_unit_is_kept_once_data_was_sent_and_given_back_otherwise(
    name: str, tmp: Path, upstream: Upstream
) -> None:
    behaviour, code, held = CASES[name]
    upstream.handler.script = [behaviour]
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        reply = await send(guard.ports[0], message(f"fate:{list(CASES).index(name)}"))
        units = await _units(guard)
    print(f"unit fate, {name}: {reply.code}; units {units}; upstream DATA {upstream.handler.data_commands}")
    assert reply.code == code, str(reply)
    assert units == (held, held)
    # A unit is held exactly when a DATA command reached the provider.
    assert upstream.handler.data_commands == held


async def test_no_provider_reachable_gives_the_unit_back(tmp: Path) -> None:
    async with running_guard(base_config(tmp, free_port())) as guard:
        reply = await send(guard.ports[0], message("fate:unreachable"))
        units = await _units(guard)
    assert reply.code == 451 and units == (0, 0), (str(reply), units)


async def test_a_duplicate_spends_no_second_unit(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        first = await send(guard.ports[0], message("fate:dup"))
        again = await send(guard.ports[0], message("fate:dup"))
        units = await _units(guard)
    assert first.code == 250 and again.code == 250 and "duplicate" in again.text
    assert units == (1, 1) and upstream.event_keys() == ["fate:dup"]


async def test_a_retry_after_a_refusal_before_data_spends_one_unit_in_all(
    tmp: Path, upstream: Upstream
) -> None:
    cfg: dict[str, Any] = base_config(tmp, upstream.port, event_key__min_retry_interval="0s")
    upstream.handler.script = [Behaviour(mail="451 4.3.0 try later")]
    async with running_guard(cfg) as guard:
        first = await send(guard.ports[0], message("fate:retry"))
        again = await send(guard.ports[0], message("fate:retry"))
        units = await _units(guard)
    assert (first.code, again.code) == (451, 250), (str(first), str(again))
    assert units == (1, 1) and upstream.handler.data_commands == 1


# --- the pure rule (policy/limits.py) ----------------------------------------------------------
ME = "018f00000000aaaaaaaa"
EARLIER = ("018e00000000bbbbbbbb", "018e00000000cccccccc")


@pytest.mark.parametrize(
    ("outcome", "refunded"),
    [
        (Outcome(Kind.DELIVERED, None, data_sent=True), ()),
        (Outcome(Kind.DEFERRED, None, data_sent=True), ()),
        (Outcome(Kind.FAILED, None, data_sent=True), ()),
        (Outcome(Kind.UNKNOWN, None, data_sent=True), ()),
        (Outcome(Kind.UNKNOWN, None), ()),  # not known whether DATA went: spent, the safe side
        (Outcome(Kind.DEFERRED, None, data_sent=False), (ME,)),
        (Outcome(Kind.FAILED, None, data_sent=False), (ME,)),
        (Outcome(Kind.UNAVAILABLE, None), (ME,)),
        (Outcome(Kind.UNAVAILABLE, None, data_sent=True), (ME,)),
    ],
)
def test_a_relayed_attempt_keeps_its_unit_unless_nothing_reached_data(
    outcome: Outcome, refunded: tuple[str, ...]
) -> None:
    assert unit_fate(Ending.RELAYED, ME, EARLIER, outcome) == refunded


def test_a_standing_reservation_refunds_the_attempts_it_took_over_and_keeps_its_own() -> None:
    assert unit_fate(Ending.RESERVED, ME, EARLIER) == EARLIER
    assert unit_fate(Ending.RESERVED, ME) == ()


def test_an_unanswered_reservation_refunds_its_unit_only_if_it_counted_one() -> None:
    assert unit_fate(Ending.RESERVE_UNANSWERED, ME, EARLIER) == (ME,)
    assert unit_fate(Ending.RESERVE_UNANSWERED, ME, EARLIER, counted=False) == ()


@pytest.mark.parametrize("ending", [Ending.LEASE_LOST, Ending.STORE_LOST, Ending.HELD])
def test_an_attempt_stopped_before_data_refunds_its_own_unit(ending: Ending) -> None:
    assert unit_fate(ending, ME, EARLIER) == (ME,)
