"""Reconciliation (DESIGN.md §19): every `reconcile.events`, ask each provider's log API for
the bounces, complaints and unsubscribes its webhooks may have missed, and apply them
through the webhook's own path (Applier), so an event has one effect whichever way it came.

Once per fleet in effect: each API's cursor (where its log has been read up to) is in the
store, and only the instance that read the cursor as it still is advances it, after the
whole period's events are applied. Two instances reading the same period apply the same
events, and the store keeps each (zone, source, event id) once, so the second finds
duplicates. A period whose API call fails, or that names a record still being sent, leaves
the cursor where it was: the next poll reads it again.

An event read here is stored under the name of the webhook source of the same kind for the
same provider when there is one (so a webhook that brings the same event id later is a
duplicate of it), else under `api:PROVIDER`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from smtpguard.events.apply import Applied, Applier, log_applied
from smtpguard.policy.verdicts import WINDOW
from smtpguard.store import Store, StoreUnavailable
from smtpguard.verdicts.http import ApiError, ApiTruncated
from smtpguard.verdicts.model import LogApi

log = logging.getLogger("smtpguard.events")

OVERLAP = WINDOW
"""Seconds each poll reads back before its cursor: an event the log shows a few minutes late
(logs are eventually consistent) is still read, and one read twice is a duplicate."""

SPLITS = 4
"""Halvings of a period with more events than one read's pages, per poll at most: a poll
then reads at least 1/16 of what is behind, and no request is spent without progress."""

Observe = Callable[[str, str, str], None]
"""(source, type, outcome) → count it, as the webhook listener does."""


def cursor_name(provider: str) -> str:
    return f"reconcile:{provider}"


@dataclass(frozen=True, slots=True)
class Polled:
    """What one poll of one API did (for the log line and the tests)."""

    provider: str
    since: float
    until: float
    outcomes: Mapping[str, int]
    advanced: bool
    error: str | None = None


@dataclass(eq=False, repr=False)
class Reconciler:
    store: Store
    applier: Applier
    apis: Mapping[str, LogApi]
    sources: Mapping[str, str]
    """provider → the source name its reconciled events are stored under."""
    period: float
    clock: Callable[[], float]
    """The server's clock: the store's, or a test's injected one."""
    observe: Observe = lambda source, kind, outcome: None

    async def poll(self) -> list[Polled]:
        """One poll of every API, each on its own: one API failing holds no other."""
        return [await self.poll_one(provider, api) for provider, api in sorted(self.apis.items())]

    async def poll_one(self, provider: str, api: LogApi) -> Polled:
        name = cursor_name(provider)
        cursor = await self.store.reconcile_cursor(name)
        now = self.clock()
        # Never read before: the last period only (a first start is not a backfill).
        start = cursor if cursor is not None else now - self.period
        for split in range(SPLITS + 1):
            # More events than one read's pages: a shorter period after the cursor (so the
            # cursor still moves) and a shorter look back, until it fits; the rest is the
            # next poll's. The look back shrinks too, or a burst just behind the cursor,
            # read again each time, would hold it for ever.
            since, until = start - OVERLAP / 2**split, start + (now - start) / 2**split
            try:
                reported = await api.reported_since(since, until)
                break
            except ApiTruncated as e:
                if split == SPLITS:
                    log.warning("reconciliation not read", extra={"provider": provider, "error": str(e)})
                    return Polled(provider, since, until, {}, False, str(e))
            except ApiError as e:
                log.warning("reconciliation not read", extra={"provider": provider, "error": str(e)})
                return Polled(provider, since, until, {}, False, str(e))
        # Under the webhook source's name where the provider has one: the webhook bringing
        # the same event id later is then a duplicate of it.
        webhook = self.sources.get(provider)
        events = [replace(e, source=webhook) if webhook else e for e in reported]
        outcomes: Counter[str] = Counter()
        for event in sorted(events, key=lambda e: e.at):
            outcome, record = await self.applier.apply(provider, event)
            outcomes[outcome.value] += 1
            self.observe(event.source, event.kind.value, outcome.value)
            log_applied(event.source, event, outcome, record)
        advanced = False
        if not outcomes[Applied.RETRY_LATER.value]:
            # Only now: a crash before this line reads the period again, and its applied
            # events are duplicates then.
            advanced = await self.store.advance_reconcile_cursor(name, cursor, until)
        log.info(
            "reconciled",
            extra={"provider": provider, "since": since, "until": until, "advanced": advanced, **outcomes},
        )
        return Polled(provider, since, until, dict(outcomes), advanced)


def source_names(apis: Mapping[str, str], sources: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    """provider → the webhook source (name) of the api's kind for that provider, first by
    name; `sources` maps each source name to its (kind, provider), `apis` each provider
    with an api to the api's kind."""
    out: dict[str, str] = {}
    for name, (kind, provider) in sorted(sources.items()):
        if apis.get(provider) == kind:
            out.setdefault(provider, name)
    return out


async def run(reconciler: Reconciler) -> None:
    """`serve`'s loop: a poll every `reconcile.events`, until cancelled. A store failure
    costs one poll, never the loop (an API failure is poll_one's to count)."""
    while True:
        # A period first: an instance restarting in a loop must not poll each time it starts.
        await asyncio.sleep(reconciler.period)
        try:
            await reconciler.poll()
        except StoreUnavailable as e:
            log.warning("reconciliation not applied: store unavailable", extra={"error": str(e)})


async def close(reconciler: Reconciler) -> None:
    for api in reconciler.apis.values():
        await api.close()
