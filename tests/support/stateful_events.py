"""Provider events in the stateful search (DESIGN.md §11, §18): a bounce for one of the
machine's events arrives at any moment relative to its send — before any send, while a
submission is held after its data_sent note or after the final dot (the provider has the
message, its 250 not yet written), after the outcome, or for a key never sent — through the
record's provider or another one, for a recipient of the message or a stranger.

`deliver_and_check` applies it with the real Applier on the real store and checks what
must hold whatever the moment:
 - in flight through that provider (the final dot may be there, no outcome written, and
   its owner's lease still live): the answer is retry-later and nothing is stored; never
   retry-later once the lease is over;
 - a key never sent, or sent only through another provider: unmatched, nothing stored;
 - otherwise applied once (the same event again is a duplicate), to the record of its own
   zone only: the other zone's list and history never change;
 - a stranger (not one of the message's recipients) is never suppressed.
The suppression a genuine bounce adds is removed again afterwards (as an operator would),
so that the rest of the run keeps sending to the machine's one recipient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smtpguard.events.apply import Applied, Applier
from smtpguard.policy.events import Kind, Match, ProviderEvent
from smtpguard.policy.ledger import Record
from smtpguard.policy.senders import recipient_tag
from smtpguard.policy.sends import in_flight_through, sent_through
from smtpguard.store import Store

STRANGER = "stranger@example.org"
SOURCE = "hooks"


@dataclass
class EventModel:
    applied: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """Per record: the event ids applied to it (each once)."""
    sent: int = 0


def _other(zone: str, zones: tuple[str, ...]) -> str:
    return next(z for z in zones if z != zone)


async def deliver_and_check(
    store: Store,
    model: EventModel,
    zones: tuple[str, ...],
    zone: str,
    key: str,
    to: str,
    via: str,
    now: float,
    again: bool,
) -> str:
    """Deliver one bounce (twice with `again`); a line for the run's notes."""
    model.sent += 1
    event_id = f"ev-{model.sent}"
    before = await store.get(zone, key)
    other = _other(zone, zones)
    other_list = {s.address for s in await store.suppress_list(other)}
    events_before = len(await store.provider_events(zone, key))
    match = Match(
        keys=(f"{zone}:{key}",),
        message_ids=(before.message_id,) if before is not None and before.message_id else (),
    )
    event = ProviderEvent(SOURCE, Kind.BOUNCE, "failed/permanent", to, "5.1.1", now, event_id, match)
    applier = Applier(store, lambda: zones, lambda: now)
    outcome, record = await applier.apply(via, event)
    brief = f"event {event_id} {zone}/{key} via {via} to {to}: {outcome.value}"

    if outcome is Applied.RETRY_LATER:
        # Stated apart from the predicate below: put off only while an owner holds the lease
        # (a dead owner's record must not answer "retry later" until the provider gives up).
        lease = before.lease_until if before is not None else None
        assert lease is not None and lease > now, f"§18 retry-later, no live lease: {brief}, {_state(before)}"
    if before is None or not sent_through(before, via):
        assert outcome is Applied.UNMATCHED, f"§18: {brief}, but the record is {_state(before)}"
    elif in_flight_through(before, via, now):
        assert outcome is Applied.RETRY_LATER, f"§18 in flight: {brief}, record {_state(before)}"
    else:
        assert outcome is Applied.APPLIED, f"§18: {brief}, record {_state(before)}"
        assert record is not None and (record.zone, record.key) == (zone, key), f"§18 another record: {brief}"
        model.applied.setdefault((zone, key), set()).add(event_id)
    stored = await store.provider_events(zone, key)
    grew = 1 if outcome is Applied.APPLIED else 0
    assert len(stored) == events_before + grew, f"§18 history: {brief}, {events_before} → {len(stored)}"

    if again:
        repeat, _ = await applier.apply(via, event)
        expected = Applied.DUPLICATE if outcome is Applied.APPLIED else outcome
        if outcome is Applied.RETRY_LATER:
            # Still held at the same moment: still in flight.
            expected = Applied.RETRY_LATER
        assert repeat is expected, f"§13 applied once: {brief}, again {repeat.value}"
        assert len(await store.provider_events(zone, key)) == len(stored), f"§13 applied once: {brief}"

    listed = {s.address for s in await store.suppress_list(zone)}
    assert STRANGER not in listed, f"§18 a stranger was suppressed: {brief}"
    if outcome is Applied.APPLIED and to != STRANGER:
        tags = before.rcpt_tags if before is not None else ()
        if not tags or recipient_tag(to) in tags:
            assert to in listed, f"§13 a recipient's bounce did not suppress: {brief}"
    assert {s.address for s in await store.suppress_list(other)} == other_list, (
        f"§18 another zone's list changed: {brief}"
    )
    # Taken off again, as `smtpguard suppress remove` would: the run goes on sending.
    for address in listed:
        await store.suppress_remove(zone, address)
    return brief


def _state(rec: Record | None) -> str:
    if rec is None:
        return "absent"
    phase = rec.phase.value if rec.phase else None
    providers = [a.provider for a in rec.attempts]
    return f"{rec.state.value} phase={phase} via={rec.via} attempts={providers}"
