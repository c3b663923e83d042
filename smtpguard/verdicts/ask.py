"""Asking a provider's log about one `unknown` record (DESIGN.md §19): the verdict loop and
`smtpguard verdict` ask the same way and settle the same way; only when they ask differs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from smtpguard.config.verdicts import VerdictsConfig
from smtpguard.policy.eventkey import qualified_key
from smtpguard.policy.events import tag_value
from smtpguard.policy.ledger import Record
from smtpguard.policy.verdict_records import attempt_of
from smtpguard.policy.verdicts import (
    Attempt,
    LogEntry,
    Verdict,
    VerdictKind,
    absence_provable,
    ingested_past,
    verdict,
)
from smtpguard.verdicts.http import ApiError
from smtpguard.verdicts.model import LogApi

PROOF_CALLS = 3
"""`accepted_since` calls per provider per round at most: each one proves ingestion past
every attempt older than the acceptances it brings, so a round of many records needs few."""


def record_attempt(rec: Record) -> Attempt | None:
    """The attempt a record's log entries are matched against, with the tag the relay
    wrote for it (the zone-qualified key, policy.tags)."""
    return attempt_of(rec, tag_value(qualified_key(rec.zone, rec.key)))


@dataclass(frozen=True, slots=True)
class Asked:
    """What one look at the log found."""

    record: Record
    attempt: Attempt
    verdict: Verdict
    entries: tuple[LogEntry, ...] = ()
    """What the log holds about the attempt's time and ids (matched or not)."""
    proof: bool = False
    """The log was found to have ingested past the attempt."""
    error: str | None = None
    """The API failed: its error's text (no key in it); the verdict is then none yet."""
    provable: bool = True
    """An absence could prove `not accepted`: the log is the one the message went to, and is
    searched by an id the message is known to carry (policy.verdicts.absence_provable)."""


class Proof:
    """The ingestion proof for one provider during one round, fetched lazily and shared by
    every record the round asks about."""

    def __init__(self, client: LogApi, calls: int = PROOF_CALLS) -> None:
        self._client = client
        self._calls = calls
        self._entries: list[LogEntry] = []
        self._lock = asyncio.Lock()

    async def proven(self, attempt: Attempt) -> bool:
        async with self._lock:
            if ingested_past(attempt, self._entries):
                return True
            if self._calls <= 0:
                return False
            self._calls -= 1
            self._entries.extend(await self._client.accepted_since(attempt.latest))
            return ingested_past(attempt, self._entries)


async def ask(
    client: LogApi,
    rec: Record,
    attempt: Attempt,
    settings: VerdictsConfig,
    now: float,
    proof: Proof | None = None,
) -> Asked:
    """Ask `client` (the log of the attempt's provider) about the record now; never raises
    for an API failure (that is `none yet`, with `error` set)."""
    proof = proof or Proof(client)
    provable = absence_provable(attempt, client.log)
    try:
        entries = tuple(await client.entries(attempt))
        found = _judge(client.log, attempt, entries, settings, now, False)
        proven = False
        if found.kind is VerdictKind.NONE_YET and now >= attempt.latest + settings.absent_after and provable:
            proven = await proof.proven(attempt)
            if proven:
                found = _judge(client.log, attempt, entries, settings, now, True)
    except ApiError as e:
        return Asked(rec, attempt, Verdict(VerdictKind.NONE_YET), error=str(e), provable=provable)
    return Asked(rec, attempt, found, entries, proven, provable=provable)


def _judge(
    log: str | None,
    attempt: Attempt,
    entries: tuple[LogEntry, ...],
    settings: VerdictsConfig,
    now: float,
    proof: bool,
) -> Verdict:
    return verdict(
        attempt,
        entries,
        now=now,
        absent_after=settings.absent_after,
        give_up=settings.give_up,
        proof_of_ingestion=proof,
        log=log,
    )
