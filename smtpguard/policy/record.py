"""The ledger record (DESIGN.md §4): its states and phases, its attempts and audit trail, the
dict every store persists (to_dict/from_dict) and evolve, the one-pass copy each transition
makes. The decisions over a record live in ledger.py, which re-exports these names."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

from smtpguard.replies import Reply


class State(StrEnum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    DELIVERED = "delivered"
    DEFERRED = "deferred"
    FAILED = "failed"
    UNKNOWN = "unknown"
    EXPIRED = "expired"


class Phase(StrEnum):
    BEFORE_DATA = "before_data"
    """Nothing can have been accepted upstream: safe to retry, safe to fail over."""
    DATA_SENT = "data_sent"
    """The final dot may have reached the provider: the outcome belongs to it."""


@dataclass(frozen=True, slots=True)
class Attempt:
    attempt_id: str
    at: float
    instance: str
    provider: str | None
    phase: str
    outcome: str
    code: int | None = None
    enhanced: str = ""
    text: str = ""
    upstream_id: str | None = None
    message_id: str | None = None
    rejected: tuple[tuple[str, Reply], ...] = ()


def lost_trace_id(sg_id: str) -> str:
    """The id of the trace a lease lost after the final dot leaves in the history
    (ledger._lost_after_dot): the attempt's own id stays free for the outcome its owner may
    still report, and the trace is read back as that attempt's (verdict_records.attempt_of)."""
    return f"{sg_id}:lost"


@dataclass(frozen=True, slots=True)
class Audited:
    """Who did what, and when: how every audit line starts, a record's own (AuditEntry) and
    a zone's (store.base.ZoneAudit)."""

    at: float
    actor: str
    """`cli:USER@HOST`, `console:USERNAME`, `verdict:…` or `smtpguard` itself."""
    action: str


@dataclass(frozen=True, slots=True)
class AuditEntry(Audited):
    from_state: str
    to_state: str
    note: str = ""


@dataclass(frozen=True, slots=True)
class Record:
    zone: str
    key: str
    state: State
    fingerprint: str
    created_at: float
    updated_at: float
    version: int
    sg_id: str
    """The current attempt's id; for a delivered record, the attempt that delivered."""
    owner: str | None = None
    lease_until: float | None = None
    phase: Phase | None = None
    next_attempt_at: float | None = None
    reply: Reply | None = None
    upstream_id: str | None = None
    message_id: str | None = None
    valid_until: float | None = None
    """Derived (`auto:`) keys only: after this the same fingerprint is a new event."""
    lane: str | None = None
    """Store-and-forward only (DESIGN.md §4a): the message class whose lane delivers it."""
    queue_id: str | None = None
    """Store-and-forward only: the id given in `250 queued as <id>`; stable across attempts."""
    expires_at: float | None = None
    """Store-and-forward only: never sent after this (the class's max_age)."""
    lost_owner: str | None = None
    """Held `unknown` because this owner lost its lease after the final dot may have gone."""
    lost_until: float | None = None
    """Until then that owner may still be in DATA with the provider (its lease plus the
    route's send timeout): `resolve --as retry` before it could send the event twice."""
    sender: str | None = None
    """The client's envelope sender (MAIL FROM), kept when relayed mail leaves with a VERP
    sender instead (DESIGN.md §18); None otherwise."""
    via: str | None = None
    """The provider the current attempt's DATA went to (noted with data_sent, before any
    outcome): how its provider's events find a record still in flight or left unknown."""
    tagged: str | None = None
    """The kind of tag (policy.tags) that provider wrote into the current attempt's message,
    noted with `via`; None when it wrote none, or when the note is older than this field. A
    log searched by its tag alone proves a message absent only when it carried that tag
    (policy.verdicts.absence_provable): a message sent before the tag was configured is
    absent from such a search, and `not accepted` would send it again."""
    log: str | None = None
    """The log that provider's `api` named, noted with `tagged` (policy.verdicts.log_identity);
    None without one: only that log may prove the message absent."""
    rcpt_tags: tuple[str, ...] = ()
    """A short hash of each envelope recipient (senders.recipient_tag): a provider event
    suppresses an address only if it was one of them, without the ledger keeping them."""
    username: str | None = None
    """The SMTP user who submitted the current attempt: store-and-forward counts the user's
    own caps (DESIGN.md §16) at delivery, when the session is gone."""
    unrefunded: tuple[str, ...] = ()
    """Cap tokens of attempts abandoned before DATA that this record's attempt took over:
    refunded after each takeover (idempotent), carried forward so that a takeover that
    dies before its refunds lands leaves them to the next one; cleared once settled."""
    owed: str | None = None
    """The fingerprint of the recipients a receiver held at RCPT (DESIGN.md §21) in the
    transaction of the current attempt: the client's retry of them alone, with this key, is
    the rest of the event and is sent to them."""
    parts: tuple[str, ...] = ()
    """The fingerprints of the event's transactions before the current one (each sent to its
    accepted recipients, the rest owed): a resubmission of one of them is a duplicate."""
    attempts: tuple[Attempt, ...] = field(default=())
    audit: tuple[AuditEntry, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "zone": self.zone,
            "key": self.key,
            "state": self.state.value,
            "fingerprint": self.fingerprint,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "version": self.version,
            "sg_id": self.sg_id,
            "owner": self.owner,
            "lease_until": self.lease_until,
            "phase": self.phase.value if self.phase else None,
            "next_attempt_at": self.next_attempt_at,
            "reply": self.reply.to_dict() if self.reply else None,
            "upstream_id": self.upstream_id,
            "message_id": self.message_id,
            "valid_until": self.valid_until,
            "lane": self.lane,
            "queue_id": self.queue_id,
            "expires_at": self.expires_at,
            "lost_owner": self.lost_owner,
            "lost_until": self.lost_until,
            "rcpt_tags": list(self.rcpt_tags),
            "unrefunded": list(self.unrefunded),
            "username": self.username,
            "attempts": [_attempt_to_dict(a) for a in self.attempts],
            **({"via": self.via} if self.via is not None else {}),
            **({"tagged": self.tagged} if self.tagged is not None else {}),
            **({"log": self.log} if self.log is not None else {}),
            **({"sender": self.sender} if self.sender is not None else {}),
            **({"owed": self.owed} if self.owed is not None else {}),
            **({"parts": list(self.parts)} if self.parts else {}),
            "audit": [
                {
                    "at": e.at,
                    "actor": e.actor,
                    "action": e.action,
                    "from_state": e.from_state,
                    "to_state": e.to_state,
                    "note": e.note,
                }
                for e in self.audit
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        return cls(
            zone=d["zone"],
            key=d["key"],
            state=State(d["state"]),
            fingerprint=d["fingerprint"],
            created_at=d["created_at"],
            updated_at=d["updated_at"],
            version=d["version"],
            sg_id=d["sg_id"],
            owner=d.get("owner"),
            lease_until=d.get("lease_until"),
            phase=Phase(d["phase"]) if d.get("phase") else None,
            next_attempt_at=d.get("next_attempt_at"),
            reply=Reply.from_dict(d["reply"]) if d.get("reply") else None,
            upstream_id=d.get("upstream_id"),
            message_id=d.get("message_id"),
            valid_until=d.get("valid_until"),
            lane=d.get("lane"),
            queue_id=d.get("queue_id"),
            expires_at=d.get("expires_at"),
            lost_owner=d.get("lost_owner"),
            lost_until=d.get("lost_until"),
            via=d.get("via"),
            tagged=d.get("tagged"),
            log=d.get("log"),
            sender=d.get("sender"),
            rcpt_tags=tuple(d.get("rcpt_tags", ())),
            unrefunded=tuple(d.get("unrefunded", ())),
            username=d.get("username"),
            owed=d.get("owed"),
            parts=tuple(d.get("parts", ())),
            attempts=tuple(_attempt_from_dict(a) for a in d.get("attempts", ())),
            audit=tuple(AuditEntry(**e) for e in d.get("audit", ())),
        )


def _attempt_to_dict(a: Attempt) -> dict[str, Any]:
    return {
        "attempt_id": a.attempt_id,
        "at": a.at,
        "instance": a.instance,
        "provider": a.provider,
        "phase": a.phase,
        "outcome": a.outcome,
        "code": a.code,
        "enhanced": a.enhanced,
        "text": a.text,
        "upstream_id": a.upstream_id,
        "message_id": a.message_id,
        "rejected": [[addr, r.to_dict()] for addr, r in a.rejected],
    }


def _attempt_from_dict(d: dict[str, Any]) -> Attempt:
    rejected = tuple((addr, Reply.from_dict(r)) for addr, r in d.get("rejected", ()))
    return Attempt(**{**d, "rejected": rejected})


_RECORD_FIELDS = tuple(f.name for f in fields(Record))
_RECORD_FIELD_SET = frozenset(_RECORD_FIELDS)


def evolve(rec: Record, **changes: Any) -> Record:
    """dataclasses.replace for a Record, in one pass over its fields: replace walks them
    twice (then calls __init__), which made a record transition cost ~9 µs; every message
    takes three or four. A name that is not a field raises, as with replace: silently
    dropped, a misspelt change would be a lost state transition."""
    if not _RECORD_FIELD_SET.issuperset(changes):
        unknown = sorted(set(changes) - _RECORD_FIELD_SET)
        raise TypeError(f"evolve: Record has no field {', '.join(unknown)}")
    new = object.__new__(Record)
    for name in _RECORD_FIELDS:
        object.__setattr__(new, name, changes[name] if name in changes else getattr(rec, name))
    return new


def bump(rec: Record, now: float, **changes: Any) -> Record:
    """A transition's copy: the next version, written now."""
    return evolve(rec, version=rec.version + 1, updated_at=now, **changes)


def audited(
    rec: Record, now: float, actor: str, action: str, before: State, after: State, note: str = ""
) -> Record:
    entry = AuditEntry(now, actor, action, before.value, after.value, note)
    return replace(rec, audit=(*rec.audit, entry))
