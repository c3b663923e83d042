"""What a verdict (DESIGN.md §19) does to a ledger record: which attempt of the record the
log is asked about, and the record after a settling verdict. Pure, as policy.verdicts is;
smtpguard/verdicts/settle.py writes the result through the store's compare-and-swap."""

from __future__ import annotations

from typing import Any

from smtpguard.policy.eventkey import message_id_for, qualified_key
from smtpguard.policy.events import Match, bare_message_id, key_of_tag
from smtpguard.policy.record import AuditEntry, Record, State, evolve, lost_trace_id
from smtpguard.policy.verdicts import Attempt, Verdict, VerdictKind
from smtpguard.replies import Reply, safe


def attempt_of(rec: Record, tag: str | None) -> Attempt | None:
    """The attempt whose outcome `rec` (unknown) leaves open, as the log is asked about it:
    the provider its DATA went to, from when until when, and its Message-ID. None when no
    provider is known (nothing can be asked). `tag` is smtpguard's tag for the record
    (tags.tagged); whether the relay wrote it is the record's `tagged`.

    From the earliest trace of the current attempt (a lost lease's trace keeps when its
    owner last wrote, not when the loss was noticed) to the latest, or to `lost_until`
    while an owner that lost its lease may still have been sending.

    None too for the rest of an event (`parts`: recipients held at RCPT by their receiver,
    DESIGN.md §21, sent after the others): its tag and Message-ID name the transaction
    accepted before it as well, whose acceptance the log holds, and would settle it
    `delivered` unsent. It waits for an operator, as an unknown without an api does."""
    if rec.parts:
        return None
    mine = [a for a in rec.attempts if a.attempt_id in (rec.sg_id, lost_trace_id(rec.sg_id))]
    provider = rec.via or next((a.provider for a in mine if a.provider is not None), None)
    if provider is None:
        return None
    times = [a.at for a in mine] or [rec.updated_at]
    latest = max([*times, rec.lost_until or times[0]])
    message_id = next((a.message_id for a in mine if a.message_id), None) or rec.message_id
    until = latest if latest > min(times) else None
    # `tagged` and `log` are noted with `via`, for the current attempt: every claim clears them.
    return Attempt(provider, min(times), tag, message_id, until, rec.tagged, rec.log)


def names_the_message(rec: Record, match: Match) -> bool:
    """Does a provider's acceptance event, matched to `rec`, prove that `rec`'s message was
    taken? Only when it names the record by an id that is the record's alone: smtpguard's
    tag, an attempt id of the record, the provider's id from one of its 250s, or the
    Message-ID smtpguard derived from the record's zone and key. A Message-ID the
    application chose is not enough: it may reuse it under a new key, and the first
    message's acceptance would settle the second `delivered` unsent, which loses it."""
    if rec.parts:
        # The rest of an event (attempt_of): only the current attempt's own id is its own;
        # the tag, the Message-ID and the earlier 250s' ids name the parts sent before.
        return rec.sg_id in match.sg_ids
    tags = {key_of_tag(tag) for tag in match.keys} - {None}
    if tags:  # smtpguard's tag decides, whatever else the event names (rule 1, §18)
        return qualified_key(rec.zone, rec.key) in tags
    attempt_ids = {rec.sg_id, *(a.attempt_id for a in rec.attempts)}
    if attempt_ids.intersection(match.sg_ids):
        return True
    upstream_ids = {rec.upstream_id, *(a.upstream_id for a in rec.attempts)} - {None}
    if upstream_ids.intersection(match.upstream_ids):
        return True
    # Its local part: the domain is the zone's hostname, which a reload may change.
    derived = _local_part(message_id_for(rec.zone, rec.key, "x"))
    return any(_local_part(m) == derived for m in match.message_ids)


def _local_part(message_id: str) -> str:
    return bare_message_id(message_id).partition("@")[0].lower()


def settled_record(
    rec: Record, verdict: Verdict, via: str, actor: str, now: float, retry_at: float
) -> Record | None:
    """The record after a settling verdict (accepted, refused, not accepted), audited under
    `actor` as `verdict:KIND`, its note the history text `verdict KIND via VIA`; None when
    it does not apply: the record is not `unknown`, or (not accepted) the owner that lost
    its lease may still be in DATA, so a send now could be the second copy. `retry_at` (not
    accepted): when the next attempt may go, the usual min_retry_interval after the attempt."""
    if rec.state is not State.UNKNOWN or not verdict.settles:
        return None
    lost: dict[str, Any] = {"lost_owner": None, "lost_until": None}
    if verdict.kind is VerdictKind.ACCEPTED:
        new = evolve(
            rec,
            state=State.DELIVERED,
            upstream_id=verdict.upstream_id or rec.upstream_id,
            next_attempt_at=None,
            **lost,
        )
    elif verdict.kind is VerdictKind.REFUSED:
        reason = verdict.reason or "refused"
        new = evolve(
            rec,
            state=State.FAILED,
            reply=Reply(550, "5.0.0", f"refused by the provider per its log: {safe(reason)}"),
            next_attempt_at=None,
            **lost,
        )
    else:
        if rec.lost_until is not None and now < rec.lost_until:
            return None
        new = evolve(rec, state=State.DEFERRED, next_attempt_at=max(now, retry_at), **lost)
    note = f"verdict {verdict.kind.value.replace('_', ' ')} via {via}"
    if verdict.kind is VerdictKind.ACCEPTED and new.upstream_id:
        note += f"; upstream id {new.upstream_id}"
    elif verdict.kind is VerdictKind.REFUSED:
        note += f"; {verdict.reason or 'refused'}"
    entry = AuditEntry(now, actor, f"verdict:{verdict.kind.value}", "unknown", new.state.value, note)
    return evolve(new, version=rec.version + 1, updated_at=now, audit=(*rec.audit, entry))
