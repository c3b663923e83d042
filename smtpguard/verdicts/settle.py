"""The one way a verdict (DESIGN.md §19) changes a record: the store's compare-and-swap, as
an operator's decision on the desk does (desk.change_record), so the verdict loop on every
instance, `smtpguard verdict` and a webhook proving acceptance can all race for the same
record and exactly one of them settles it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from smtpguard.desk import NotFound, Refused, change_record
from smtpguard.policy import ledger
from smtpguard.policy.ledger import Record
from smtpguard.policy.verdict_records import attempt_of, settled_record
from smtpguard.policy.verdicts import Verdict
from smtpguard.store import Store

Channel = Literal["api", "events"]
log = logging.getLogger("smtpguard.verdicts")


def actor_of(name: str) -> str:
    """The audit actor of a verdict from provider (api) or source (events) `name`."""
    return f"verdict:{name}"


async def settle(
    store: Store,
    zone: str,
    key: str,
    verdict: Verdict,
    channel: Channel,
    name: str,
    *,
    attempt_id: str | None = None,
    min_retry_interval: float = 60.0,
    clock: Callable[[], float] | None = None,
) -> Record | None:
    """Apply `verdict` to the record of `zone`/`key`; the written record, or None when it
    was left alone.

    `channel` and `name` say where the verdict came from: ("api", PROVIDER) for the log
    API of providers[].name PROVIDER, ("events", SOURCE) for a signed webhook of
    events.sources SOURCE. Audited as `verdict:NAME` with the history text `verdict
    accepted via api PROVIDER` (or `via events SOURCE`), in the record and the zone's
    audit.

    accepted → `delivered` with the log's upstream id; refused → `failed` with the log's
    reason; not accepted → `deferred`, the next attempt allowed `min_retry_interval` after
    the unknown attempt (a store-and-forward record is re-queued, due then). A verdict
    that does not settle (none yet, gave up) changes nothing.

    Left alone (None): no such record; a record that is not `unknown` (an operator, a
    webhook or another instance settled it first: the compare-and-swap re-reads and sees
    it); with `attempt_id`, a record whose current attempt is another one (the verdict is
    about an attempt since retried); a not-accepted verdict while an owner that lost its
    lease may still be sending.

    `clock`: the server's clock (a test's injected one); default the store's, as the desk.
    """
    if not verdict.settles:
        return None
    actor = actor_of(name)

    def change(rec: Record, store_now: float) -> Record:
        now = clock() if clock is not None else store_now
        if attempt_id is not None and rec.sg_id != attempt_id:
            raise ledger.OperatorRefused(f"{zone} {key}: attempt {attempt_id} is no longer the current one")
        attempt = attempt_of(rec, None)
        retry_at = (attempt.at if attempt is not None else now) + min_retry_interval
        new = settled_record(rec, verdict, f"{channel} {name}", actor, now, retry_at)
        if new is None:
            raise ledger.OperatorRefused(f"{zone} {key} is {rec.state.value}; the verdict does not apply")
        return new

    try:
        return await change_record(store, zone, key, change, actor, f"verdict:{verdict.kind.value}")
    except (NotFound, Refused) as e:
        log.info(
            "verdict left the record alone",
            extra={"zone": zone, "event_key": key, "verdict": verdict.kind.value, "why": str(e)},
        )
        return None
