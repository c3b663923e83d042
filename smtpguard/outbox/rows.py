"""Every statement on an outbox table: claim due rows, write a receipt, count by state.

Every column the application writes is read as possibly NULL (a table made by its own model
rather than `outbox schema` may allow it): a NULL key is the empty key, a NULL message an
empty one, a NULL sender None, each refused on its row alone; a NULL created_at is the
claim's time, NULL attempts none. One such row once failed the whole claim, and with it
every row of its batch, for good.

Times are read as epoch seconds (date_part), not as timestamps: a column the application
wrote as 'infinity' or '-infinity' (PostgreSQL's own "never" and "at once") is a float, where
loading it as a datetime would fail the whole claim, and with it every row of the batch.

Claims are short transactions: `FOR UPDATE SKIP LOCKED` picks due rows no other instance is
claiming, and the claim itself is `next_attempt_at` pushed past the ledger lease. An
instance killed with its claims simply lets them come due again; the ledger (not the row)
decides whether anything is sent, so a second instance or a restart never sends twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from psycopg import AsyncConnection, sql
from psycopg.rows import TupleRow

from smtpguard.policy.outbox import OPEN, RowState

CLAIM_OCTETS = 64 * 1024 * 1024
"""The most message octets one claim reads (besides its first row, always taken): a batch
of large messages read whole would hold about three times its size in serve (bytea
arrives as hex text), 7 GB for 100 rows near the 25 MB default limit, and end serve, SMTP
included, and again at each restart on the same rows."""


def stamp(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    event_key: str
    message: bytes
    """Empty when `size` is over the size limit the claim was given: never read into memory."""
    size: int
    """The message's octets as stored."""
    mail_from: str | None
    rcpt_to: tuple[str | None, ...]
    """An element may be NULL: the column is the application's (refused at submission)."""
    created_at: float
    not_before: float | None
    attempts: int
    sg_id: str | None
    state: RowState
    problem: str | None = None
    """Why the row could not be read (a column of another type than the DDL's): it fails."""


@dataclass(frozen=True, slots=True)
class Written:
    state: RowState
    reply: str | None
    sg_id: str | None
    upstream_id: str | None
    next_attempt_at: float | None
    done: bool
    event_key: str
    """The key of the row as it was read: the receipt answers that event, and a row the
    application has since rewritten to another key is not its to take."""


_CLAIM = """
WITH fresh AS (
    SELECT id, next_attempt_at, octet_length(message) AS octets FROM {t}
    WHERE state IN ('pending', 'held') AND next_attempt_at IS NULL
      AND (not_before IS NULL OR not_before <= %(now)s)
    ORDER BY next_attempt_at, id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), retried AS (
    SELECT id, next_attempt_at, octet_length(message) AS octets FROM {t}
    WHERE state IN ('pending', 'held') AND next_attempt_at <= %(now)s
      AND (not_before IS NULL OR not_before <= %(now)s)
    ORDER BY next_attempt_at, id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), due AS (
    SELECT id, next_attempt_at, CASE WHEN octets <= %(max_size)s THEN octets ELSE 0 END AS size
    FROM (SELECT * FROM fresh UNION ALL SELECT * FROM retried) AS open_rows
    ORDER BY next_attempt_at NULLS FIRST, id
    LIMIT %(batch)s
), taken AS (
    SELECT id FROM (
        SELECT id,
            sum(size) OVER w AS read,
            row_number() OVER w AS n
        FROM due
        WINDOW w AS (ORDER BY next_attempt_at NULLS FIRST, id)
    ) AS running
    WHERE n = 1 OR read <= %(octets)s
)
UPDATE {t} AS o
SET next_attempt_at = %(until)s,
    attempts = coalesce(o.attempts, 0)
        + CASE WHEN o.sg_id IS NULL AND coalesce(o.attempts, 0) < 2147483647 THEN 1 ELSE 0 END
FROM taken WHERE o.id = taken.id
RETURNING o.id, coalesce(o.event_key, ''),
    CASE WHEN octet_length(o.message) <= %(max_size)s THEN o.message END,
    coalesce(octet_length(o.message), 0),
    o.mail_from, o.rcpt_to, date_part('epoch', coalesce(o.created_at, %(now)s)),
    date_part('epoch', o.not_before), o.attempts, o.sg_id, o.state,
    (SELECT count(*) FROM due)
"""
"""Never-tried rows first (`fresh`), then those whose retry time came (`retried`): each read
along the table's partial index (next_attempt_at, id) in its order, a batch at most, where
one `next_attempt_at IS NULL OR <= now` condition sorted every open row at each claim (a
backlog of 200,000 rows: 250 ms a claim, where this takes under 1 ms). The rows locked
and not taken are free again when the claim's short transaction ends.

The rows of `due` past the octet bound stay unclaimed (their lock ends with the claim's
transaction): the next pass, at once, takes them. The first due row is always taken, so a
message larger than the bound alone is claimed on its own."""

_RECEIPT = """
UPDATE {t}
SET state = %(state)s, reply = coalesce(%(reply)s, reply), sg_id = %(sg_id)s,
    upstream_id = coalesce(%(upstream_id)s, upstream_id),
    next_attempt_at = %(next)s, done_at = CASE WHEN %(done)s THEN %(now)s END
WHERE id = (
    SELECT id FROM {t}
    WHERE id = %(id)s AND coalesce(event_key, '') = %(key)s AND state IN ('pending', 'held')
    FOR UPDATE SKIP LOCKED
)
RETURNING id
"""

_RELEASE = """
UPDATE {t}
SET next_attempt_at = NULL,
    attempts = attempts - CASE WHEN sg_id IS NULL AND attempts > 0 THEN 1 ELSE 0 END
WHERE id = ANY(%(ids)s) AND state IN ('pending', 'held')
"""

_STILL_OPEN = """
SELECT id, coalesce(event_key, '') FROM {t} WHERE id = ANY(%(ids)s) AND state IN ('pending', 'held')
"""
"""Of the receipts no row took: the rows still open (a plain read, never waits on a lock).
The others hold a final receipt or were deleted: nothing more to write."""

_REWRITTEN = """
UPDATE {t}
SET next_attempt_at = NULL
WHERE id = ANY(
    SELECT id FROM {t} WHERE id = ANY(%(ids)s) AND state IN ('pending', 'held') FOR UPDATE SKIP LOCKED
)
"""
"""Rows rewritten to another event while their first was sent: due at once, as the event
they now hold (one still locked by the application comes due when its claim lapses)."""

_COUNTS = """
SELECT state, count(*),
       date_part('epoch', min(greatest(created_at, not_before)) FILTER (WHERE state = 'pending'))
FROM {t} GROUP BY state
"""

_OPEN_COUNTS = """
SELECT state, count(*),
       date_part('epoch', min(greatest(created_at, not_before)) FILTER (WHERE state = 'pending'))
FROM {t} WHERE state IN ('pending', 'held') GROUP BY state
"""
"""The open states alone: read through the table's partial index (`_due`), whatever the
number of final receipts the table keeps, where _COUNTS reads every row."""


def _q(template: str, table: str) -> sql.Composed:
    return sql.SQL(template).format(t=sql.Identifier(table))


@dataclass(frozen=True, slots=True)
class Claimed:
    rows: list[Row]
    more: bool
    """More rows were due than this claim took (its batch, or its octet bound): the next
    pass starts at once rather than at the next poll."""


async def claim(
    conn: AsyncConnection[TupleRow],
    table: str,
    now: float,
    until: float,
    batch: int,
    max_size: int,
    octets: int = CLAIM_OCTETS,
) -> Claimed:
    """Due rows, oldest first, claimed until `until` in one short transaction: at most
    `batch` of them, and no more message octets than `octets` past the first row. A message
    over `max_size` stays in the database (it is refused by its size alone) and counts for
    nothing: a batch of them read whole could take more memory than serve has."""
    params = {
        "now": stamp(now),
        "until": stamp(until),
        "batch": batch,
        "max_size": max_size,
        "octets": octets,
    }
    async with conn.transaction():
        cur = await conn.execute(_q(_CLAIM, table), params)
        found = await cur.fetchall()
    taken = [_row(r, now) for r in found]
    due = int(found[0][11]) if found else 0
    return Claimed(taken, due > len(taken) or len(taken) >= batch)


def _row(r: Sequence[Any], now: float) -> Row:
    """One claimed row as read. A column of another type than the DDL's (the application's
    own model: `message` as text, `rcpt_to` as json) is read where it can be (text is the
    message's UTF-8); a row that cannot be read at all is claimed with its `problem`, to fail
    on its own: a whole claim, every row of its batch, once failed on one such row."""
    try:
        message = r[2].encode() if isinstance(r[2], str) else b"" if r[2] is None else bytes(r[2])
        return Row(
            int(r[0]),
            str(r[1]),
            message,
            int(r[3]),
            None if r[4] is None else str(r[4]),
            tuple(r[5] or ()),
            float(r[6]),
            None if r[7] is None else float(r[7]),
            int(r[8]),
            r[9],
            RowState(r[10]),
        )
    except (TypeError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
        return Row(int(r[0]), str(r[1]), b"", 0, None, (), now, None, 1, None, RowState.PENDING, problem)


async def write(
    conn: AsyncConnection[TupleRow], table: str, receipts: Mapping[int, Written], now: float
) -> set[int]:
    """Receipts by row id, in one transaction (one commit for many rows: the drain rate is
    not one fsync per row). A row that already holds a final receipt (another instance's,
    written first) is left alone: a final receipt is never rewritten. A reply or upstream
    id of None keeps the row's (a followed row that is still waiting).

    A row the application holds locked (a transaction of its own left open on it) is
    skipped rather than waited for: the ids returned are those still to be written, so one
    open transaction never holds up the receipts of every other row, nor the next claim.
    A row deleted meanwhile is done with: its receipt has nowhere to go. A row the
    application rewrote to another event_key meanwhile is not answered by it either: the
    receipt is dropped and the row made due, to be submitted as the event it now holds."""
    params = [
        {
            "state": w.state.value,
            "reply": w.reply,
            "sg_id": w.sg_id,
            "upstream_id": w.upstream_id,
            "next": stamp(w.next_attempt_at) if w.next_attempt_at is not None else None,
            "done": w.done,
            "now": stamp(now),
            "id": row_id,
            "key": w.event_key,
        }
        for row_id, w in receipts.items()
    ]
    async with conn.transaction(), conn.cursor() as cur:
        # Pipelined: one round trip for every receipt, as without the lock check.
        await cur.executemany(_q(_RECEIPT, table), params, returning=True)
        taken: set[int] = set()
        while True:
            taken.update(int(r[0]) for r in await cur.fetchall())
            if not cur.nextset():
                break
        untaken = [i for i in receipts if i not in taken]
        if not untaken:
            return set()
        await cur.execute(_q(_STILL_OPEN, table), {"ids": untaken})
        still_open = {int(r[0]): str(r[1]) for r in await cur.fetchall()}
        rewritten = [i for i, key in still_open.items() if key != receipts[i].event_key]
        if rewritten:
            # The receipt's event is not the row's any more: dropped, and the row submitted
            # again as the event it holds now (the ledger answers the first one's key).
            await cur.execute(_q(_REWRITTEN, table), {"ids": rewritten})
        return {i for i, key in still_open.items() if key == receipts[i].event_key}


async def release(conn: AsyncConnection[TupleRow], table: str, claimed: Sequence[Row]) -> None:
    """Claims of rows that were never submitted, given back: each row due at once (it was
    due when claimed), the attempt its claim counted taken back."""
    await conn.execute(_q(_RELEASE, table), {"ids": [r.id for r in claimed]})


async def counts(
    conn: AsyncConnection[TupleRow], table: str, whole: bool = True
) -> tuple[dict[str, int], float | None]:
    """Rows per state smtpguard writes (each named, 0 included) and when the longest-waiting
    pending row became due: its created_at, or its not_before when that is later (mail
    scheduled for tomorrow is not late today). Not `whole`: the open states only (pending,
    held), through the index, without reading the table's final receipts."""
    cur = await conn.execute(_q(_COUNTS if whole else _OPEN_COUNTS, table))
    out = {s.value: 0 for s in (RowState if whole else OPEN)}
    oldest: float | None = None
    for state, n, first in await cur.fetchall():
        if state not in out:
            # Not a state smtpguard writes: a table whose CHECK the application dropped to
            # keep states of its own. Its rows are the application's; as labels they would
            # be series without bound.
            continue
        out[str(state)] = int(n)
        if first is not None:
            oldest = float(first)
    return out, oldest
