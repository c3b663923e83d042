"""Verdicts in the stateful search (DESIGN.md §11, §19): a provider's log settles an event's
record at any moment — in flight, held unknown (also while an owner that lost its lease may
still be in DATA), after an operator's decision, queued, deferred, delivered, never sent —
with any verdict the log could truthfully give then. The log is the provider's truth, seen
late: with a copy taken it shows the acceptance or nothing yet; without one it shows a
refusal, nothing yet, or (proof of ingestion given) the message's absence.

`apply_verdict` settles through the real settle() on the real store and checks what must
hold whatever the moment: only an `unknown` record changes, to the state its verdict names,
audited under `verdict:PROVIDER`; anything else is left exactly as it was. The machine's
own invariant then checks the rest: never two upstream acceptances of one event.
"""

from __future__ import annotations

from collections.abc import Callable

from smtpguard.policy.ledger import State
from smtpguard.policy.verdicts import Verdict, VerdictKind
from smtpguard.store import Store
from smtpguard.verdicts.settle import settle

PROVIDER = "primary"
KINDS = ("accepted", "refused", "not_accepted", "none_yet")
_STATES = {
    VerdictKind.ACCEPTED: State.DELIVERED,
    VerdictKind.REFUSED: State.FAILED,
    VerdictKind.NOT_ACCEPTED: State.DEFERRED,
}


def truthful(drawn: str, provider_has_copy: bool) -> VerdictKind:
    """What the log can say: an acceptance wins over any other drawn verdict when the
    provider has a copy; with none, a drawn acceptance is its absence."""
    kind = VerdictKind(drawn)
    if kind is VerdictKind.NONE_YET:
        return kind
    if provider_has_copy:
        return VerdictKind.ACCEPTED
    return VerdictKind.NOT_ACCEPTED if kind is VerdictKind.ACCEPTED else kind


async def apply_verdict(
    store: Store,
    zone: str,
    key: str,
    kind: VerdictKind,
    clock: Callable[[], float],
    min_retry_interval: float,
) -> tuple[str, bool]:
    """Settle (zone, key) with `kind`; a line for the run's notes, and whether it changed."""
    before = await store.get(zone, key)
    asked_at = clock()
    verdict = Verdict(kind, "up-1" if kind is VerdictKind.ACCEPTED else None, "refused by log")
    written = await settle(
        store, zone, key, verdict, "api", PROVIDER, min_retry_interval=min_retry_interval, clock=clock
    )
    after = await store.get(zone, key)
    brief = f"verdict {kind.value} {zone}/{key}: {before.state.value if before else 'absent'}"
    if written is None:
        assert after == before, f"§19 left alone, yet changed: {brief}"
        if before is not None and before.state is State.UNKNOWN:
            # Only two reasons leave an unknown record alone: no verdict yet, or an owner
            # that lost its lease may still be in DATA (a send now could be a second copy).
            may_send = before.lost_until is not None and asked_at < before.lost_until
            settles_not = kind is VerdictKind.NONE_YET or (kind is VerdictKind.NOT_ACCEPTED and may_send)
            assert settles_not, f"§19 an unknown record was left alone: {brief}"
        return f"{brief} → left alone", False
    assert before is not None and before.state is State.UNKNOWN, f"§19 a verdict changed a {brief} record"
    assert written.state is _STATES[kind], f"§19 {brief} became {written.state.value}"
    last = written.audit[-1]
    audited = (last.actor, last.action)
    assert audited == (f"verdict:{PROVIDER}", f"verdict:{kind.value}"), f"§19 audit: {brief}"
    return f"{brief} → {written.state.value}", True
