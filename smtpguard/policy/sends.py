"""Which provider a record's message went to, and whether its send is still going on: how a
provider's event finds the record and whether it is answered "retry later" (DESIGN.md §18).
Pure: the clock is a parameter."""

from __future__ import annotations

from smtpguard.policy.ledger import Phase, Record, State


def sent_through(record: Record, provider: str) -> bool:
    """The record has an attempt through `provider`, or its current attempt's DATA went
    there (in flight, or left unknown by a lost lease before its outcome was written)."""
    return record.via == provider or any(a.provider == provider for a in record.attempts)


def sent_as(record: Record, sg_id: str) -> bool:
    """`sg_id` is the record's attempt now or one in its history (a retry, or a derived
    key's new event, gets a new id; the attempts keep the earlier ones)."""
    return record.sg_id == sg_id or any(a.attempt_id == sg_id for a in record.attempts)


def in_flight_through(record: Record, provider: str, now: float) -> bool:
    """The final dot may be with `provider`, the outcome is not written yet, and an owner
    still holds the lease to write it. Once the lease is over nobody is sending any more:
    the record is as good as `unknown` (the next submission or claim writes it so), and an
    event about it applies instead of being put off until the provider stops retrying."""
    return (
        record.state is State.IN_FLIGHT
        and record.phase is Phase.DATA_SENT
        and record.via == provider
        and record.lease_until is not None
        and record.lease_until > now
        and not any(a.attempt_id == record.sg_id for a in record.attempts)
    )
