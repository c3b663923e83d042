"""Find the ledger record a provider event is about, and apply the event to it (§13).

Matching is restricted to records the event's provider could have sent: the record has an
attempt through the source's `provider`, or its current attempt's DATA went there. It tries
the zone-qualified key smtpguard wrote and the provider echoed, then smtpguard's attempt
id, the upstream id from the provider's 250, and last the Message-ID; an id that names
records in two zones (two clients chose the same Message-ID), or records sent through
another provider too, is not trusted and the next way is tried — the store applies the
two-zone rule in its query, so no row limit hides the other zone (DESIGN.md §18). An event
that finds no record changes nothing; one about a send still in flight is answered "retry
later".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from enum import StrEnum

from smtpguard.policy.events import Match, ProviderEvent, StoredEvent, effect_of, key_of_tag
from smtpguard.policy.ledger import Record
from smtpguard.policy.sends import in_flight_through, sent_through
from smtpguard.store import Store
from smtpguard.store.base import IdField

log = logging.getLogger("smtpguard.events")


class Applied(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    UNMATCHED = "unmatched"
    RETRY_LATER = "retry_later"
    """The record's send through this provider is in flight (the final dot sent, the
    outcome not yet written): answered so that the sender tries again (503, 4xx), never
    dropped as unmatched."""


class Applier:
    def __init__(
        self,
        store: Store,
        zones: Callable[[], Collection[str]],
        clock: Callable[[], float],
        on_suppressed: Callable[[str], None] = lambda zone: None,
        on_event: Callable[[str, str, str], None] = lambda zone, recipient, kind: None,
    ) -> None:
        self.store = store
        self.zones = zones
        self.clock = clock
        self.on_suppressed = on_suppressed
        """Told the zone whose list an event added to (this instance's suppression cache
        then reads it at once; other instances within a second)."""
        self.on_event = on_event
        """Told (zone, recipient, type) of every event applied: the receivers' counts
        (DESIGN.md §21)."""

    async def apply(self, provider: str, event: ProviderEvent) -> tuple[Applied, Record | None]:
        """A verified webhook's event: found through the ids of its Match, then applied."""
        return await self.apply_to(provider, await self.find(provider, event.match), event)

    async def apply_to(
        self, provider: str, record: Record | None, event: ProviderEvent, trusted: bool = True
    ) -> tuple[Applied, Record | None]:
        """Apply `event` to `record`. Untrusted (a mailed report without a token that
        verifies, DESIGN.md §18), it joins the history marked `unverified` and never
        suppresses."""
        if record is None:
            return Applied.UNMATCHED, None
        if in_flight_through(record, provider, self.clock()):
            return Applied.RETRY_LATER, record
        reason, effect = effect_of(event, record.rcpt_tags)
        event_id = event.event_id
        if not trusted:
            # Its own id: an unverified copy that came first must not make the genuine
            # report a duplicate of it.
            reason, effect, event_id = None, "unverified", f"unverified:{event_id}"
        stored = StoredEvent(
            at=event.at,
            source=event.source,
            type=event.kind.value,
            provider_type=event.provider_type,
            recipient=event.recipient,
            status=event.status,
            id=event_id,
            effect=effect,
            received_at=self.clock(),
        )
        applied = await self.store.apply_event(record.zone, record.key, stored, reason)
        if not applied:
            return Applied.DUPLICATE, record
        if reason:
            self.on_suppressed(record.zone)
        if trusted and event.recipient:
            self.on_event(record.zone, event.recipient, event.kind.value)
        return Applied.APPLIED, record

    async def find(self, provider: str, match: Match) -> Record | None:
        zones = self.zones()
        for tag in match.keys:
            qualified = key_of_tag(tag)
            if qualified is None:
                continue
            zone, sep, key = qualified.partition(":")
            if sep and zone in zones:
                record = await self.store.get(zone, key)
                if record is not None and sent_through(record, provider):
                    return record
        # Ids that name one message first: smtpguard's own attempt id, the provider's id
        # from its 250; the Message-ID (a client may reuse one) last.
        lookups: list[tuple[IdField, str]] = [("sg_id", i) for i in match.sg_ids]
        lookups += [("upstream_id", u) for u in match.upstream_ids]
        lookups += [("message_id", m) for m in match.message_ids]
        for field, value in lookups:
            if not value.strip():
                continue
            # records_for_event answers nothing for an id records of two zones share.
            found = await self.store.records_for_event(field, value)
            if any(r.zone not in zones for r in found):
                continue
            ours = [r for r in found if sent_through(r, provider)]
            if ours and len(ours) == len(found):
                # One zone, one provider (an application that reused a Message-ID under a
                # new key): the suppression is the zone's either way; the history joins
                # the newest record. Records of that id sent through another provider make
                # it name neither.
                return max(ours, key=lambda r: r.updated_at)
        return None


def log_applied(source: str, event: ProviderEvent, outcome: Applied, record: Record | None) -> None:
    """The one log line of an event the webhook listener or the mailbox has applied."""
    log.info(
        "provider event",
        extra={
            "source": source,
            "type": event.kind.value,
            "provider_type": event.provider_type,
            "event_id": event.event_id,
            "outcome": outcome.value,
            "zone": record.zone if record else None,
            "event_key": record.key if record else None,
            "status": event.status,
        },
    )
