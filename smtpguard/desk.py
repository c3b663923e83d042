"""The operator's changes to a record, one code path for the CLI and the console (§14).

A decision on a held record is taken once. The store's compare-and-swap decides, not the
page: a console page carries the version of the record it showed, and a decision made on a
stale page finds another version and is refused naming who decided and when. The CLI acts
on the record as it is now (no version), so `resolve` after someone else's resolve is
refused by the ledger's own rule (the record is no longer unknown) and says who did it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from smtpguard.policy import ledger
from smtpguard.policy.ledger import AuditEntry, Record
from smtpguard.policy.queue import queue_due
from smtpguard.store import Store, StoreUnavailable
from smtpguard.store.base import ZoneAudit

Change = Callable[[Record, float], Record]
_HELD = ("unknown", "failed")
log = logging.getLogger("smtpguard.desk")

DECISIONS = ("delivered", "retry", "release")
"""What can be decided on a held record: resolve an `unknown` as delivered or as retry,
release a `failed` one."""


class DeskError(Exception):
    status = 400


class NotFound(DeskError):
    status = 404


class Refused(DeskError):
    """The record's state does not allow it (the ledger's rule says why)."""

    status = 409


@dataclass(frozen=True, slots=True)
class Decision:
    actor: str
    action: str
    at: float

    def describe(self) -> str:
        when = datetime.fromtimestamp(self.at, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        return f"{self.actor} at {when}"


class AlreadyDecided(Refused):
    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        verb = "released" if decision.action == "release" else "resolved"
        super().__init__(f"already {verb} by {decision.describe()}")


def last_decision(rec: Record) -> Decision | None:
    """The latest operator decision in the record's audit, if any."""
    for entry in reversed(rec.audit):
        if _is_decision(entry):
            return Decision(entry.actor, entry.action, entry.at)
    return None


def _is_decision(entry: AuditEntry) -> bool:
    return entry.action.startswith("resolve:") or entry.action == "release"


def decision_change(action: str, actor: str, force: bool = False) -> Change:
    if action in ("delivered", "retry"):
        return lambda r, now: ledger.resolve(r, action, actor, now, force)
    if action == "release":
        return lambda r, now: ledger.release(r, actor, now, force)
    raise DeskError(f"unknown decision {action!r}: one of {', '.join(DECISIONS)}")


async def change_record(
    store: Store,
    zone: str,
    key: str,
    change: Change,
    actor: str,
    action: str,
    expected_version: int | None = None,
) -> Record:
    """Apply an operator's change by compare-and-swap, then note it in the zone's audit.
    With `expected_version` (a page's), any other version is a stale page: refused."""
    for _ in range(10):
        rec = await store.get(zone, key)
        if rec is None:
            raise NotFound(f"no record for zone {zone} key {key!r}")
        if expected_version is not None and rec.version != expected_version:
            decided = last_decision(rec)
            if decided is not None and rec.state.value not in _HELD:
                raise AlreadyDecided(decided)
            # Still held (or never decided): an older decision is not the news; the page is.
            raise Refused(f"the record changed since this page was shown (now {rec.state.value}); reload it")
        now = store.now()
        try:
            new = change(rec, now)
        except ledger.OperatorRefused as e:
            decided = last_decision(rec)
            if decided is not None and rec.state.value not in _HELD:
                raise AlreadyDecided(decided) from None
            raise Refused(str(e)) from None
        if rec.lane is not None:
            # Store-and-forward: the queue entry moves with the record, atomically.
            written = await store.requeue(new, rec.version, queue_due(new))
        else:
            written = await store.put(new, rec.version)
        if written is None:
            try:
                await store.audit_add(zone, ZoneAudit(now, actor, action, key))
            except StoreUnavailable as e:
                # The change is made and the record's own audit holds it; only the zone's
                # list of decisions misses it. Not worth telling the operator it failed.
                log.warning(
                    "zone audit not written",
                    extra={"zone": zone, "event_key": key, "action": action, "error": str(e)},
                )
            return new
        if expected_version is not None:
            continue  # re-read: the winner's decision is what the refusal names
    raise Refused("the record kept changing; try again")


async def decide(
    store: Store,
    zone: str,
    key: str,
    action: str,
    actor: str,
    expected_version: int | None,
    force: bool = False,
) -> Record:
    return await change_record(
        store, zone, key, decision_change(action, actor, force), actor, f"decide:{action}", expected_version
    )
