"""Webhook verdicts (DESIGN.md §19): a signed event that proves the provider took a message
settles its `unknown` record as `delivered`, with or without an `api` or a `verdicts:`
section, through the one settle path the verdict loop uses (smtpguard/verdicts/settle.py:
the store's compare-and-swap, audited `verdict:SOURCE`).

Which event types prove acceptance is the pure table in policy/verdicts.py. The record is
the one the webhook's trusted matching found (events/apply.py, §18): a forged or unsigned
request never gets here, and an event naming another record's tag finds that record, not
this one. A record that is not `unknown` (delivered already, or an operator decided first)
is left alone by settle itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from smtpguard.events.apply import Applied
from smtpguard.policy.events import ProviderEvent
from smtpguard.policy.ledger import Record, State
from smtpguard.policy.verdict_records import names_the_message
from smtpguard.policy.verdicts import Verdict, VerdictKind, proves_acceptance
from smtpguard.store import Store
from smtpguard.verdicts.settle import settle

log = logging.getLogger("smtpguard.events")

SETTLING = (Applied.APPLIED, Applied.DUPLICATE)
"""A duplicate too: the first delivery of the event may have been applied while its settle
failed (the store went away in between); the provider's retry then settles."""


async def settle_if_accepted(
    store: Store,
    source_kind: str,
    source: str,
    event: ProviderEvent,
    outcome: Applied,
    record: Record | None,
    clock: Callable[[], float] | None = None,
) -> Record | None:
    """The record as settled, or None when the event settles nothing."""
    if record is None or outcome not in SETTLING or record.state is not State.UNKNOWN:
        return None
    if not proves_acceptance(source_kind, event.provider_type):
        return None
    if not names_the_message(record, event.match):
        return None
    upstream_id = event.match.upstream_ids[0] if event.match.upstream_ids else None
    settled = await settle(
        store,
        record.zone,
        record.key,
        Verdict(VerdictKind.ACCEPTED, upstream_id),
        "events",
        source,
        clock=clock,
    )
    if settled is not None:
        log.info(
            "verdict accepted via events",
            extra={
                "source": source,
                "zone": record.zone,
                "event_key": record.key,
                "provider_type": event.provider_type,
                "event_id": event.event_id,
            },
        )
    return settled
