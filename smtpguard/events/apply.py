"""Find the ledger record a provider event is about, and apply the event to it (§13).

Matching is restricted to records the event's provider could have sent: the record has an
attempt through the source's `provider`. It tries the zone-qualified key the provider
echoed, then the Message-ID, then the upstream id from the provider's 250; an id that names
records in two zones (two clients chose the same Message-ID) is not trusted and the next
way is tried. An event that finds no record changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from enum import StrEnum

from smtpguard.events.model import Match, ProviderEvent, StoredEvent, effect_of
from smtpguard.policy.ledger import Record
from smtpguard.store import Store
from smtpguard.store.base import IdField

log = logging.getLogger("smtpguard.events")


class Applied(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    UNMATCHED = "unmatched"


class Applier:
    def __init__(
        self,
        store: Store,
        zones: Callable[[], Collection[str]],
        clock: Callable[[], float],
        on_suppressed: Callable[[str], None] = lambda zone: None,
    ) -> None:
        self.store = store
        self.zones = zones
        self.clock = clock
        self.on_suppressed = on_suppressed
        """Told the zone whose list an event added to (this instance's suppression cache
        then reads it at once; other instances within a second)."""

    async def apply(self, provider: str, event: ProviderEvent) -> tuple[Applied, Record | None]:
        record = await self.find(provider, event.match)
        if record is None:
            return Applied.UNMATCHED, None
        reason, effect = effect_of(event, record.rcpt_tags)
        stored = StoredEvent(
            at=event.at,
            source=event.source,
            type=event.kind.value,
            provider_type=event.provider_type,
            recipient=event.recipient,
            status=event.status,
            id=event.event_id,
            effect=effect,
            received_at=self.clock(),
        )
        applied = await self.store.apply_event(record.zone, record.key, stored, reason)
        if not applied:
            return Applied.DUPLICATE, record
        if reason:
            self.on_suppressed(record.zone)
        return Applied.APPLIED, record

    async def find(self, provider: str, match: Match) -> Record | None:
        zones = self.zones()
        for qualified in match.keys:
            zone, sep, key = qualified.partition(":")
            if sep and zone in zones:
                record = await self.store.get(zone, key)
                if record is not None and _sent_through(record, provider):
                    return record
        lookups: list[tuple[IdField, str]] = [("sg_id", i) for i in match.sg_ids]
        lookups += [("message_id", m) for m in match.message_ids]
        lookups += [("upstream_id", u) for u in match.upstream_ids]
        for field, value in lookups:
            if not value.strip():
                continue
            found = [
                r
                for r in await self.store.find_records(field, value)
                if r.zone in zones and _sent_through(r, provider)
            ]
            if len({r.zone for r in found}) == 1:
                # One zone (an application that reused a Message-ID under a new key): the
                # suppression is the zone's either way; the history joins the newest record.
                return max(found, key=lambda r: r.updated_at)
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


def _sent_through(record: Record, provider: str) -> bool:
    return any(a.provider == provider for a in record.attempts)
