"""The outbox's decisions (DESIGN.md §20): what a submission's answer makes of a row, when a
row is tried again, when it expires, and what a settled ledger record makes of a held row.

Pure: the clock and the jitter are parameters, so every row of the tables below is a unit test.
The pipeline that answers is the SMTP one (submission.py); this only reads its answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from smtpguard import replies
from smtpguard.policy.decisions import Decision
from smtpguard.policy.eventkey import written_key
from smtpguard.policy.fingerprint import fingerprint
from smtpguard.policy.message import HeaderLimits, parse
from smtpguard.policy.queue import backoff_delay
from smtpguard.replies import Reply


class RowState(StrEnum):
    PENDING = "pending"
    SENT = "sent"
    DUPLICATE = "duplicate"
    FAILED = "failed"
    HELD = "held"
    EXPIRED = "expired"


OPEN = (RowState.PENDING, RowState.HELD)
"""States smtpguard still works on; every other one is a receipt that is never rewritten."""


@dataclass(frozen=True, slots=True)
class Retry:
    """How a row is tried again: the queue's backoff, never sooner than min_retry_interval."""

    base: float
    ceiling: float
    min_interval: float
    follow_every: float
    """How often a held or queued row looks at its record until the record settles."""


@dataclass(frozen=True, slots=True)
class Receipt:
    state: RowState
    next_attempt_at: float | None
    """When the row is looked at again (open states only)."""
    done: bool
    follow: bool = False
    """The row's own submission is the record's: later passes read the record, never submit."""


_FOLLOWED = frozenset({Decision.QUEUED, Decision.UNKNOWN, Decision.UNKNOWN_HELD})


def receipt(
    decision: str,
    reply: Reply,
    now: float,
    due_at: float,
    max_age: float,
    attempts: int,
    retry: Retry,
    jitter: float,
) -> Receipt:
    """The row's state after one submission answered `reply` (decided as `decision`).

    A 250 is `sent`, or `duplicate` when the ledger answered for an earlier 250. An unknown
    outcome (the final dot may have reached the provider) is `held`: the row follows the
    record until a verdict or an operator settles it. A queued acceptance stays `pending`
    and follows its record too. Any other 4xx (caps, pause, backoff, no provider, the store
    away, a message that never reached DATA) is tried again later, until the message class's
    max_age counted from `due_at` (became_due), then `expired`; a 5xx is `failed` with its
    reply."""
    if decision in _FOLLOWED:
        state = RowState.PENDING if decision == Decision.QUEUED else RowState.HELD
        return Receipt(state, now + retry.follow_every, False, follow=True)
    if decision == Decision.DUPLICATE:
        return Receipt(RowState.DUPLICATE, None, True)
    if reply.ok:
        return Receipt(RowState.SENT, None, True)
    if reply.permanent:
        return Receipt(RowState.FAILED, None, True)
    if now - due_at >= max_age:
        return Receipt(RowState.EXPIRED, None, True)
    delay = max(backoff_delay(max(attempts, 1), retry.base, retry.ceiling, jitter), retry.min_interval)
    return Receipt(RowState.PENDING, min(now + delay, due_at + max_age), False)


def became_due(created_at: float, not_before: float | None) -> float:
    """When a row became due: written, or its not_before when later. A row's age (its
    class's max_age, the lag gauge) counts from here: mail scheduled for next week is not
    stale, nor late, before next week."""
    return created_at if not_before is None else max(created_at, not_before)


def settled(record_state: str | None) -> RowState | None:
    """What a followed row becomes once its record settled, or None while it has not.

    `deferred`: an operator's `resolve --as retry`, a "not accepted" verdict, or a queued
    delivery's 4xx waiting in its lane: the row goes back to being submitted (the ledger
    decides when it may be sent again). A record gone (purged past retention) cannot be
    followed any more; the row is submitted again and the ledger answers it."""
    match record_state:
        case "delivered":
            return RowState.SENT
        case "failed":
            return RowState.FAILED
        case "expired":
            return RowState.EXPIRED
        case "deferred" | None:
            return RowState.PENDING
    return None


def settled_reply(
    state: RowState, reply: Reply | None, sg_id: str, upstream_id: str | None, settled_by: str
) -> Reply | None:
    """The reply a followed row's receipt takes from its settled record: the record's own,
    except for a `sent` row whose record holds no 250 (an unknown outcome has no reply, and
    the operator or verdict that settled it as delivered gave none): then a 250 naming its
    sg id and who settled it, never the `451 … held` the row read while it waited."""
    if state is RowState.SENT and (reply is None or not reply.ok):
        return replies.settled_delivered(sg_id, upstream_id, settled_by)
    return reply


def is_records_message(
    message: bytes,
    mail_from: str | None,
    rcpt_to: tuple[str | None, ...],
    limits: HeaderLimits,
    record_fingerprint: str,
) -> bool:
    """Is the row's message the one its record was written for? A followed row takes its
    receipt from the record, and `sg_id` and `state` are columns the application can write:
    a row that replaced a sent one under the same key, its sg_id copied, would otherwise
    read `sent` for a message that never went. False: submit it, and the ledger answers it
    (a duplicate, or `reused`) as SMTP would."""
    if mail_from is None or None in rcpt_to:
        # No submission took this envelope (a NULL in either is refused 501): submitted,
        # it is refused as such; never fingerprinted, which cannot read a NULL.
        return False
    parsed = parse(wire_form(message), limits)
    if isinstance(parsed, Reply):
        return False
    return fingerprint(mail_from, [r for r in rcpt_to if r is not None], parsed) == record_fingerprint


_UNSAFE_KEY = re.compile(r"[\x00-\x20\x7f]")
_LINE_ENDS = re.compile(rb"\r\n|\r(?!\n)|\n")


def wire_form(message: bytes) -> bytes:
    """The message as an SMTP client puts it on the wire: every line ended by CRLF, as
    smtplib, Django and Rails do before DATA. An application writes `as_bytes()` with bare
    LFs, which on the wire would be refused as smuggling; a NUL stays and is refused."""
    return _LINE_ENDS.sub(b"\r\n", message)


def with_key(message: bytes, header: str, key: str, limits: HeaderLimits) -> bytes | Reply:
    """The message carrying the row's event_key in the key header the zone reads.

    The row's column is the key (DESIGN.md §20). A message that names a different key in
    that header is refused rather than sent under either of them. Its header is read as the
    listener reads it (unfolded by policy.message.parse, a key folded as encoded-words
    decoded by eventkey.written_key): its first line alone may name another key than the
    one the message would be recorded under. A message the parser refuses gets the key and
    is refused by admission, with the reply the listener gives it."""
    if not key or _UNSAFE_KEY.search(key):
        # Checked before the header is written: a CR or LF in the key would add headers.
        return replies.malformed_key(
            header, "empty, or whitespace or control characters in the row's event_key"
        )
    parsed = parse(message, limits)
    values = parsed.get_all(header) if not isinstance(parsed, Reply) else []
    if not values:
        return f"{header}: {key}\r\n".encode() + message
    if any(written_key(value) != key for value in values):
        return replies.malformed_key(header, f"the message's {header} is not the row's event_key")
    return message


def size_refusal(size: int, limit: int) -> Reply | None:
    """The SMTP listener's size limit (limits.max_message_size), the same for a row of
    `size` octets."""
    return replies.SIZE_EXCEEDED if size > limit else None
