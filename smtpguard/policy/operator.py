"""An operator's decisions over a record (DESIGN.md §4, §14; runbook): resolve an `unknown`
outcome, release a `failed` event, drop or retry a queued one. Each refuses a record in a
state it does not apply to; ledger.py re-exports them."""

from __future__ import annotations

from smtpguard.policy.record import Record, State, audited, bump
from smtpguard.policy.utc import iso_z
from smtpguard.replies import Reply


class OperatorRefused(Exception):
    """An operator command that does not apply to the record's current state."""


def resolve(rec: Record, as_: str, actor: str, now: float, force: bool = False) -> Record:
    """Close an `unknown` outcome after checking with the provider (runbook: resolve).

    `retry` is refused while the owner that lost its lease may still be in DATA (it may
    yet get its 250, and the retry would be a second copy), unless `force`."""
    if rec.state is not State.UNKNOWN:
        raise OperatorRefused(f"{rec.zone} {rec.key} is {rec.state.value}, not unknown; nothing to resolve")
    if as_ == "delivered":
        new = bump(rec, now, state=State.DELIVERED, lost_owner=None, lost_until=None)
    elif as_ == "retry":
        if rec.lost_until is not None and now < rec.lost_until and not force:
            raise RetryTooEarly(rec.lost_owner or "?", rec.lost_until)
        new = bump(rec, now, state=State.DEFERRED, next_attempt_at=now, lost_owner=None, lost_until=None)
    else:
        raise OperatorRefused(f"--as must be delivered or retry, not {as_!r}")
    note = "forced while its owner may still be sending" if force and as_ == "retry" else ""
    return audited(new, now, actor, f"resolve:{as_}", State.UNKNOWN, new.state, note)


class RetryTooEarly(OperatorRefused):
    """`resolve --as retry` while the owner that lost its lease may still be in DATA."""

    def __init__(self, owner: str, possible_at: float) -> None:
        self.owner = owner
        self.possible_at = possible_at
        when = iso_z(possible_at)
        super().__init__(
            f"owner {owner} may still be sending this event to its provider (it lost its lease "
            f"after the final dot may have gone); a retry is safe from {when}, or use --force"
        )


def release(rec: Record, actor: str, now: float, force: bool = False) -> Record:
    """Allow one new attempt of a `failed` event once its cause is fixed. Refused, as
    `resolve --as retry` is, while an owner that lost its lease may still be sending (a
    held event an operator dropped keeps that fact), unless `force`."""
    if rec.state is not State.FAILED:
        raise OperatorRefused(f"{rec.zone} {rec.key} is {rec.state.value}, not failed; nothing to release")
    if rec.lost_until is not None and now < rec.lost_until and not force:
        raise RetryTooEarly(rec.lost_owner or "?", rec.lost_until)
    new = bump(rec, now, state=State.DEFERRED, next_attempt_at=now, lost_owner=None, lost_until=None)
    note = "forced while its owner may still be sending" if force and rec.lost_until else ""
    return audited(new, now, actor, "release", State.FAILED, State.DEFERRED, note)


def drop(rec: Record, actor: str, now: float) -> Record:
    """`queue drop`: the operator gives up on a queued event; it becomes failed."""
    if rec.lane is None or rec.state not in (State.QUEUED, State.DEFERRED, State.UNKNOWN):
        raise OperatorRefused(
            f"{rec.zone} {rec.key} is {rec.state.value}; only queued, deferred or "
            "unknown store-and-forward events can be dropped"
        )
    new = bump(
        rec, now, state=State.FAILED, reply=Reply(550, "5.0.0", "dropped by operator"), next_attempt_at=None
    )
    return audited(new, now, actor, "drop", rec.state, State.FAILED, "dropped by operator")


def retry_now(rec: Record, actor: str, now: float) -> Record:
    """`queue retry`: deliver a queued or deferred event at the next worker pass."""
    if rec.lane is None or rec.state not in (State.QUEUED, State.DEFERRED):
        raise OperatorRefused(
            f"{rec.zone} {rec.key} is {rec.state.value}; only queued or deferred "
            "store-and-forward events can be retried now"
        )
    new = bump(rec, now, next_attempt_at=now)
    return audited(new, now, actor, "queue_retry", rec.state, rec.state)
