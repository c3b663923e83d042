"""The event ledger: one record per zone + key, and every transition it may take (DESIGN.md §4).

Everything that affects a transition lives here. The store only offers compare-and-swap on
a record's `version`, so these functions decide and the store makes the write atomic: a
writer that lost a race gets the current record back and decides again.

    (none) ──reserve──▶ in_flight ──▶ delivered | deferred | failed | unknown
                          ▲  │ lease expired: before_data ▶ retryable, data_sent ▶ unknown
    deferred (after min_retry_interval), failed (released), unknown (resolved as retry) ─┘
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from smtpguard import replies
from smtpguard.policy.decisions import Decision
from smtpguard.policy.operator import OperatorRefused as OperatorRefused
from smtpguard.policy.operator import RetryTooEarly as RetryTooEarly
from smtpguard.policy.operator import drop as drop
from smtpguard.policy.operator import release as release
from smtpguard.policy.operator import resolve as resolve
from smtpguard.policy.operator import retry_now as retry_now
from smtpguard.policy.outcome import Kind, Outcome

# The record and its stored shape live in record.py; re-exported so that every import of
# them from the ledger keeps working.
from smtpguard.policy.record import Attempt as Attempt
from smtpguard.policy.record import AuditEntry as AuditEntry
from smtpguard.policy.record import Phase as Phase
from smtpguard.policy.record import Record as Record
from smtpguard.policy.record import State as State
from smtpguard.policy.record import audited as _audit
from smtpguard.policy.record import bump as _bump
from smtpguard.policy.record import evolve as evolve
from smtpguard.policy.record import lost_trace_id
from smtpguard.replies import Reply

KEPT_HISTORY = 20
"""Attempts and audit entries a derived key's new event keeps of the events before it:
enough to read what happened, bounded so that a message sent every window does not grow
one record without end."""

_UNOWNED: Mapping[str, None] = MappingProxyType({"owner": None, "lease_until": None, "phase": None})
"""The changes by which an attempt lets go of its record: no owner, no lease, no phase."""


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    min_retry_interval: float = 60.0
    lease: float = 30.0
    derive_window: float = 600.0
    send_timeout: float = 0.0
    """The longest a provider session may still run after its owner's lease was last
    renewed (the route's longest DATA plus command timeout): until then an owner that lost
    its lease may still be sending, so the event must not be resent."""


@dataclass(frozen=True, slots=True)
class Submission:
    """One client submission of an event, as the ledger needs to see it."""

    zone: str
    key: str
    fingerprint: str
    attempt_id: str
    instance: str
    message_id: str | None
    derived: bool = False
    lane: str | None = None
    """Set for a zone in store-and-forward mode: accept into this lane instead of relaying."""
    max_age: float | None = None
    rcpt_tags: tuple[str, ...] = ()
    username: str | None = None
    """The SMTP user who submitted it: its own caps (DESIGN.md §16) are counted when the
    message is sent, which in store-and-forward is long after the session."""
    sender: str | None = None
    """The client's envelope sender, kept when VERP replaces it on the wire (§18)."""
    earlier_fingerprint: str | None = None
    """The message's fingerprint under the earlier boundary rule, where it differs: a record
    written by that rule is this message's too."""
    owed: str | None = None
    """The fingerprint of the recipients a receiver held at RCPT in this transaction (its
    `fingerprint` covers them too: all the client named), or None when none was held."""
    accepted_fingerprint: str | None = None
    """Where a receiver held recipients at RCPT: the fingerprint of the recipients accepted
    alone, as a release before `owed` hashed this transaction. A record of that release (no
    `owed`, no `parts`) with it is this event's (a rolling upgrade, docs/receivers.md)."""


# --- verdicts --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Answer:
    """Reply now; nothing is written and nothing is sent."""

    reply: Reply
    decision: Decision


@dataclass(frozen=True, slots=True)
class Wait:
    """Another submission holds a live lease on this key: wait for its outcome."""


@dataclass(frozen=True, slots=True)
class Proceed:
    """Write `record` (compare-and-swap on `expected_version`), then relay."""

    record: Record
    expected_version: int | None
    refund: tuple[str, ...] = ()
    """Cap tokens of attempts this one takes over (their owners died before DATA, or a
    reservation's reply was lost): nothing of them reached a provider, so once the write
    stands their units go back (refunds are idempotent)."""


@dataclass(frozen=True, slots=True)
class Transition:
    """Write `record`, then answer `reply` (e.g. a lost lease after the dot becomes unknown)."""

    record: Record
    expected_version: int
    reply: Reply
    decision: Decision


Verdict = Answer | Wait | Proceed | Transition


def decide(existing: Record | None, sub: Submission, now: float, s: LedgerSettings) -> Verdict:
    """What to do with a submission given the key's current record (DESIGN.md §3 rows)."""
    if existing is None:
        return Proceed(_fresh(sub, now, s), None)
    leased = (
        existing.state is State.IN_FLIGHT and existing.lease_until is not None and existing.lease_until > now
    )
    if existing.valid_until is not None and existing.valid_until <= now and _replaceable(existing):
        # A derived key's window is over: the same fingerprint is a new event. The history
        # of the old one stays with the record.
        fresh = _fresh(sub, now, s)
        fresh = replace(
            fresh,
            version=existing.version + 1,
            attempts=existing.attempts[-KEPT_HISTORY:],
            audit=existing.audit[-KEPT_HISTORY:],
        )
        note = f"derive_window over; previous event {existing.state.value} as sg:{existing.sg_id}"
        return Proceed(
            _audit(fresh, now, "smtpguard", "new_event", existing.state, fresh.state, note), existing.version
        )
    if existing.fingerprint not in (sub.fingerprint, sub.earlier_fingerprint):
        if not _held_before_owed(existing, sub):
            return _rest_of_event(existing, sub, now, s) or Answer(
                replies.key_reused(sub.key), Decision.REUSED
            )
        # Read as this release writes it, should it be written: the fingerprint of all the
        # client named. Not a part: that transaction is this one, and nothing of it was
        # sent unless this record says so (a part answers duplicate; a verdict would not
        # settle the record by its own acceptance).
        existing = evolve(existing, fingerprint=sub.fingerprint)

    state = existing.state
    if _in_lane(existing):
        # Accepted for store-and-forward: the worker owns retries; the client is done.
        queued_as = existing.queue_id or existing.sg_id
        return Answer(replies.duplicate_queued(sub.key, queued_as), Decision.DUPLICATE)
    if state is State.DELIVERED:
        return Answer(replies.duplicate(sub.key, existing.sg_id, existing.upstream_id), Decision.DUPLICATE)
    if state is State.QUEUED:
        return Answer(replies.duplicate_queued(sub.key, existing.sg_id), Decision.DUPLICATE)
    if state is State.IN_FLIGHT:
        if leased:
            return Wait()
        if existing.phase is Phase.DATA_SENT:
            # The owner died after the final dot may have gone out: a blind retry is how
            # duplicates are made (RFC 1047). Hold it for an operator.
            lost = _lost_after_dot(existing, now, s)
            return Transition(lost, existing.version, replies.outcome_unknown(sub.key), Decision.UNKNOWN_HELD)
        # The owner died (or its reservation's reply was lost) before DATA: nothing was
        # sent, so this submission takes over and the abandoned attempt's unit goes back.
        taken = replace(_retry(existing, sub, now, s), unrefunded=_abandoned(existing))
        return Proceed(taken, existing.version, refund=taken.unrefunded)
    if state is State.DEFERRED:
        if existing.next_attempt_at is not None and now < existing.next_attempt_at:
            return Answer(replies.retry_too_soon(sub.key, existing.next_attempt_at), Decision.TOO_SOON)
        return Proceed(_retry(existing, sub, now, s), existing.version)
    if state is State.FAILED:
        return Answer(existing.reply or replies.malformed_message("failed"), Decision.FAILED_HELD)
    if state is State.UNKNOWN:
        return Answer(replies.outcome_unknown(sub.key), Decision.UNKNOWN_HELD)
    return Answer(replies.expired(sub.key), Decision.EXPIRED)


def _held_before_owed(existing: Record, sub: Submission) -> bool:
    """Is `existing` a record a release before `owed` wrote of this transaction? That release
    hashed the recipients accepted at RCPT alone: its deferred send's retry here, a receiver
    holding the same recipients again, is the same event (550 reused lost the accepted ones)."""
    return (
        sub.accepted_fingerprint is not None
        and existing.fingerprint == sub.accepted_fingerprint
        and existing.owed is None
        and not existing.parts
    )


def recorded_before_owed(earlier: Record | None, sub: Submission) -> bool:
    """Is `earlier`, the record under the key a release before `owed` derived of this
    transaction's accepted recipients alone, this submission's event? It is when it names
    this transaction (by either release's fingerprint) or one of its parts."""
    if earlier is None or sub.accepted_fingerprint is None:
        return False
    named = earlier.fingerprint in (sub.fingerprint, sub.accepted_fingerprint)
    return named or sub.fingerprint in earlier.parts


def _rest_of_event(existing: Record, sub: Submission, now: float, s: LedgerSettings) -> Verdict | None:
    """A submission of the key with another fingerprint that is still this event's: the
    client's retry of the recipients a receiver held at RCPT (DESIGN.md §21; `owed`), or a
    resubmission of a transaction of the event sent before (`parts`). None: a reused key."""
    if sub.fingerprint in existing.parts:
        return Answer(replies.duplicate(sub.key, existing.sg_id, existing.upstream_id), Decision.DUPLICATE)
    if existing.owed is None or existing.owed != sub.fingerprint or existing.lane is not None:
        return None
    if existing.state is State.DELIVERED:
        rest = _retry(existing, sub, now, s)
        rest = evolve(
            rest,
            fingerprint=sub.fingerprint,
            parts=(*existing.parts, existing.fingerprint)[-KEPT_HISTORY:],
            rcpt_tags=tuple(sorted({*existing.rcpt_tags, *sub.rcpt_tags})),
        )
        note = "the recipients held at RCPT by their receiver, retried"
        rest = _audit(rest, now, "smtpguard", "rest", State.DELIVERED, rest.state, note)
        return Proceed(rest, existing.version)
    if existing.state is State.FAILED:
        return Answer(existing.reply or replies.malformed_message("failed"), Decision.FAILED_HELD)
    if existing.state is State.UNKNOWN:
        return Answer(replies.outcome_unknown(sub.key), Decision.UNKNOWN_HELD)
    # The accepted recipients' own send is on its way or to be retried: the held ones wait
    # for its outcome (sent now, a retry of that send would leave them out).
    later = max(now + s.min_retry_interval, existing.next_attempt_at or 0.0)
    return Answer(replies.retry_too_soon(sub.key, later), Decision.TOO_SOON)


KEPT_UNREFUNDED = 8


def _abandoned(rec: Record) -> tuple[str, ...]:
    """The tokens whose units a takeover of `rec` (in flight, before DATA, lease over) gives
    back: its own attempt's, and those an earlier takeover may not have lived to refund."""
    return (*rec.unrefunded, rec.sg_id)[-KEPT_UNREFUNDED:]


def _in_lane(rec: Record) -> bool:
    """The event's message is stored in a store-and-forward lane that a worker delivers."""
    return rec.lane is not None and rec.state in (State.QUEUED, State.DEFERRED, State.IN_FLIGHT)


def _replaceable(rec: Record) -> bool:
    """May a new event take this derived key's record once its window is over?

    Only a record that can no longer be sent by accident (DESIGN.md §11.1): delivered,
    expired, or deferred in relay mode (the client's retry is the only sender). Never an
    `unknown` or `failed` one — replacing it would resend what an operator must decide on —
    nor anything in flight or waiting in a lane, which is still on its way."""
    if rec.state in (State.DELIVERED, State.EXPIRED):
        return True
    return rec.state is State.DEFERRED and rec.lane is None


def _lost_after_dot(rec: Record, now: float, s: LedgerSettings) -> Record:
    """The owner's lease ran out after the final dot may have gone: nobody knows the outcome.

    The owner may not be dead: a stalled process, failing renewals or a store failover can
    end a lease while its session is still in DATA. Until its send timeout has run out it
    may still get its 250, so that moment is kept for `resolve --as retry` to respect."""
    last_lease = rec.lease_until if rec.lease_until is not None else now
    # The lost attempt in the history, so an operator sees when and where it ran; its own
    # id stays free for the owner's outcome, should the owner still report one. Its time is
    # the owner's last write (the data_sent note or a renewal), not this moment, which may
    # be hours later: the provider's log is read about the time the message went.
    trace = Attempt(
        attempt_id=lost_trace_id(rec.sg_id),
        at=min(rec.updated_at, now),
        instance=rec.owner or "?",
        provider=rec.via,
        phase=Phase.DATA_SENT.value,
        outcome="unknown",
        text="lease lost after the data_sent note: the final dot may have reached the provider",
        message_id=rec.message_id,
    )
    lost = _bump(
        rec,
        now,
        state=State.UNKNOWN,
        owner=None,
        lease_until=None,
        lost_owner=rec.owner,
        lost_until=max(last_lease, now) + s.send_timeout,
        attempts=(*rec.attempts, trace),
    )
    return _audit(
        lost,
        now,
        "smtpguard",
        "lease_expired",
        State.IN_FLIGHT,
        State.UNKNOWN,
        f"owner {rec.owner} lost its lease after noting data_sent (the final dot may have gone)",
    )


def _fresh(sub: Submission, now: float, s: LedgerSettings) -> Record:
    common: dict[str, Any] = {
        "zone": sub.zone,
        "key": sub.key,
        "fingerprint": sub.fingerprint,
        "created_at": now,
        "updated_at": now,
        "version": 1,
        "sg_id": sub.attempt_id,
        "message_id": sub.message_id,
        "rcpt_tags": sub.rcpt_tags,
        "valid_until": now + s.derive_window if sub.derived else None,
        "username": sub.username,
        "sender": sub.sender,
        "owed": sub.owed,
    }
    if sub.lane is not None:
        return Record(**common, **_queued(sub, now))
    return Record(**common, **_leased(sub.instance, now, s))


def _queued(sub: Submission, now: float) -> dict[str, Any]:
    """The changes that put a submission into its store-and-forward lane, due at once."""
    return {
        "state": State.QUEUED,
        "next_attempt_at": now,
        "lane": sub.lane,
        "queue_id": sub.attempt_id,
        "expires_at": now + sub.max_age if sub.max_age is not None else None,
    }


def _leased(owner: str, now: float, s: LedgerSettings) -> dict[str, Any]:
    """The changes by which an attempt takes the record: in flight, owned and leased, nothing
    sent yet and to no provider."""
    return {
        "state": State.IN_FLIGHT,
        "owner": owner,
        "lease_until": now + s.lease,
        "phase": Phase.BEFORE_DATA,
        "via": None,
        "tagged": None,
        "log": None,
    }


def _retry(existing: Record, sub: Submission, now: float, s: LedgerSettings) -> Record:
    retried = {
        "sg_id": sub.attempt_id,
        "message_id": sub.message_id or existing.message_id,
        "rcpt_tags": existing.rcpt_tags or sub.rcpt_tags,
        "username": sub.username or existing.username,
        "sender": sub.sender or existing.sender,
        "owed": sub.owed,
    }
    if sub.lane is not None:
        # The zone delivers by queue now (it was in relay mode when this record was
        # written): the retry is accepted into the lane as a new attempt, as a new event
        # would be, and the worker sends it.
        return _bump(existing, now, **_UNOWNED, **_queued(sub, now), **retried)
    return _bump(existing, now, **_leased(sub.instance, now, s), next_attempt_at=None, **retried)


# --- the owner's writes while it relays ------------------------------------------------------
def owns(rec: Record, attempt_id: str) -> bool:
    return rec.state is State.IN_FLIGHT and rec.sg_id == attempt_id


class MaxAgeReached(Exception):
    """A store-and-forward entry's max_age ran out after its claim, before its DATA (while
    it waited for a connection of the provider's pool, connected, greeted): it is never
    sent now (DESIGN.md §4a). Raised instead of writing the data_sent note."""


def mark_data_sent(
    rec: Record,
    attempt_id: str,
    now: float,
    s: LedgerSettings,
    provider: str | None = None,
    tagged: str | None = None,
    log: str | None = None,
) -> Record | None:
    """Persisted before DATA: from here a crash means `unknown`, never a blind retry.
    `provider` is where the DATA goes: its events find the record before the outcome is
    written, and after a lost lease (DESIGN.md §18); `tagged`, the kind of tag it writes
    into the message, and `log`, the log its `api` names (Record.tagged, Record.log). An
    entry past its max_age raises MaxAgeReached: the note is the last point before which
    nothing can have been accepted."""
    if not owns(rec, attempt_id):
        return None
    if rec.expires_at is not None and now >= rec.expires_at:
        raise MaxAgeReached(rec.expires_at)
    return _bump(
        rec, now, phase=Phase.DATA_SENT, lease_until=now + s.lease, via=provider, tagged=tagged, log=log
    )


def renew_lease(rec: Record, attempt_id: str, now: float, s: LedgerSettings) -> Record | None:
    if not owns(rec, attempt_id):
        return None
    return _bump(rec, now, lease_until=now + s.lease)


def _attempt_phase(rec: Record, attempt_id: str, outcome: Outcome) -> str:
    # The record's phase says what may have happened (data_sent is noted while MAIL and RCPT
    # go out); the outcome, when it knows, says what did.
    if outcome.data_sent is not None:
        return (Phase.DATA_SENT if outcome.data_sent else Phase.BEFORE_DATA).value
    return rec.phase.value if rec.phase and rec.sg_id == attempt_id else Phase.BEFORE_DATA.value


def settle(
    rec: Record,
    attempt_id: str,
    instance: str,
    outcome: Outcome,
    now: float,
    s: LedgerSettings,
    message_id: str | None = None,
    retry_delay: float | None = None,
) -> Record:
    """Record an attempt's outcome. Idempotent per attempt; the truth of a 250 always wins.

    `retry_delay` (store-and-forward): when a deferred or unavailable attempt is retried by
    the worker, instead of `min_retry_interval` (client retries) or at once.

    If the lease was lost meanwhile (another instance took the key over), the attempt is
    still appended to the history, and a delivery still marks the event delivered: that
    is what happened upstream, and it is what stops the next duplicate.
    """
    if any(a.attempt_id == attempt_id for a in rec.attempts):
        return rec
    reply = outcome.reply
    attempt = Attempt(
        attempt_id=attempt_id,
        at=now,
        instance=instance,
        provider=outcome.provider,
        phase=_attempt_phase(rec, attempt_id, outcome),
        outcome=outcome.kind.value,
        code=reply.code if reply else None,
        enhanced=reply.enhanced if reply else "",
        text=(reply.text if reply else outcome.detail),
        upstream_id=outcome.upstream_id,
        message_id=message_id,
        rejected=outcome.rejected,
    )
    rec = evolve(rec, attempts=(*rec.attempts, attempt))
    # The owner that lost its lease after noting data_sent has its answer, and nobody has
    # acted on the event since (it is still unknown, still this attempt's): whatever it
    # learnt — a refusal at MAIL or RCPT, a reply to the dot — is known now, and the event
    # is no longer unknown. Only a lost reply leaves it unknown.
    reported = rec.state is State.UNKNOWN and rec.lost_owner == instance and rec.sg_id == attempt_id
    if reported:
        rec = replace(rec, lost_until=None)
    if not owns(rec, attempt_id) and not reported and outcome.kind is not Kind.DELIVERED:
        return _bump(rec, now)
    common: dict[str, Any] = {**_UNOWNED, "unrefunded": ()}
    if outcome.kind is Kind.DELIVERED:
        return _bump(
            rec,
            now,
            state=State.DELIVERED,
            sg_id=attempt_id,
            reply=reply,
            upstream_id=outcome.upstream_id,
            next_attempt_at=None,
            **common,
        )
    if outcome.kind is Kind.FAILED:
        return _bump(rec, now, state=State.FAILED, reply=reply, next_attempt_at=None, **common)
    if outcome.kind is Kind.UNKNOWN:
        return _bump(rec, now, state=State.UNKNOWN, reply=None, **common)
    if outcome.kind is Kind.DEFERRED:
        deferred, delay = reply, s.min_retry_interval if retry_delay is None else retry_delay
    else:
        # Nothing reached a provider: the event stays retryable at once (a client retry), or
        # after the worker's backoff (store-and-forward).
        deferred, delay = replies.no_provider(), retry_delay or 0.0
    return _bump(rec, now, state=State.DEFERRED, reply=deferred, next_attempt_at=now + delay, **common)


# --- store-and-forward (DESIGN.md §4a) -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Deliver:
    """The worker takes this attempt: write `record` (in_flight, owned), then relay."""

    record: Record
    refund: tuple[str, ...] = ()
    """As Proceed.refund: the cap tokens of attempts whose workers died before DATA."""


@dataclass(frozen=True, slots=True)
class Finish:
    """Write `record` and take it off the queue without sending (expired, lost, settled)."""

    record: Record | None
    decision: str
    refund: tuple[str, ...] = ()
    """As Deliver.refund: an entry that expires under a worker that died before DATA."""


ClaimVerdict = Deliver | Finish


def on_claim(rec: Record, attempt_id: str, instance: str, now: float, s: LedgerSettings) -> ClaimVerdict:
    """What a worker does with a queue entry it claimed."""
    if rec.state in (State.DELIVERED, State.FAILED, State.UNKNOWN, State.EXPIRED):
        return Finish(None, "settled")
    if rec.state is State.IN_FLIGHT:
        if rec.lease_until is not None and rec.lease_until > now:
            return Finish(None, "busy")
        if rec.phase is Phase.DATA_SENT:
            return Finish(_lost_after_dot(rec, now, s), Decision.UNKNOWN_HELD)
    if rec.expires_at is not None and now >= rec.expires_at:
        abandoned = _abandoned(rec) if rec.state is State.IN_FLIGHT else rec.unrefunded
        return Finish(_expired(rec, now), Decision.EXPIRED, refund=abandoned)
    taken = _bump(rec, now, **_leased(instance, now, s), sg_id=attempt_id, next_attempt_at=None)
    # An in_flight record here lost its worker before DATA: its unit goes back.
    if rec.state is State.IN_FLIGHT:
        taken = replace(taken, unrefunded=_abandoned(rec))
    return Deliver(taken, refund=taken.unrefunded)


def _expired(rec: Record, now: float) -> Record:
    gone = _bump(rec, now, state=State.EXPIRED, next_attempt_at=None, **_UNOWNED)
    gone = _audit(
        gone,
        now,
        "smtpguard",
        "expired",
        rec.state,
        State.EXPIRED,
        f"older than its class's max_age ({rec.lane})",
    )
    return replace(gone, unrefunded=())


def expire(rec: Record, attempt_id: str, now: float) -> Record | None:
    """The owner of a claimed entry stopped before DATA by MaxAgeReached: `expired`, off the
    queue, no attempt recorded (nothing reached a provider). None if it no longer owns it.
    The caller refunds the attempt's unit; the units of the attempts its claim took over
    went back when it took them (Deliver.refund)."""
    if not owns(rec, attempt_id):
        return None
    return _expired(rec, now)


def attempts_of_this_event(rec: Record) -> int:
    """Attempts since the event began (a derived key's record keeps earlier events' too)."""
    return sum(1 for a in rec.attempts if a.at >= rec.created_at)


def hold(rec: Record, attempt_id: str, now: float, until: float) -> Record | None:
    """Give a claimed entry back unsent (zone paused or capped, its route throttled): no
    attempt is recorded. Due again at `until`, or at its max_age if that comes first, so
    that it is expired then rather than when the hold ends."""
    if not owns(rec, attempt_id):
        return None
    if rec.expires_at is not None:
        until = min(until, rec.expires_at)
    state = State.DEFERRED if attempts_of_this_event(rec) else State.QUEUED
    return _bump(rec, now, state=state, next_attempt_at=until, **_UNOWNED)


def wake(rec: Record, now: float, within: float) -> Record | None:
    """A held store-and-forward entry due within `within` made due now (a resumed class's
    entries, held while it was paused); None when it is not such an entry. No attempt, no
    audit: it only comes back sooner."""
    if rec.lane is None or rec.state not in (State.QUEUED, State.DEFERRED):
        return None
    if rec.next_attempt_at is None or not now < rec.next_attempt_at <= now + within:
        return None
    return _bump(rec, now, next_attempt_at=now)
