"""The outbox reader of one source: woken by LISTEN/NOTIFY, polling as the fallback; claims
due rows, submits each through the SMTP pipeline (submit.py), writes the receipt back.

The application's database may go away at any moment. The reader then reconnects with
backoff and never stops serve; a receipt it could not write is kept and written once the
database is back (unless another instance wrote a final one first), so no row is marked
while away and none is lost: a claim is only a time, and a row whose claim lapsed is
submitted again, which the ledger answers without sending twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import TupleRow

from smtpguard import replies
from smtpguard.config import OutboxSource
from smtpguard.outbox import rows, schema
from smtpguard.outbox.connection import connect
from smtpguard.outbox.rows import Row, Written
from smtpguard.outbox.submit import EnvelopeChecks, submit_row
from smtpguard.policy import outbox as policy
from smtpguard.policy.classes import class_names
from smtpguard.policy.message import parse
from smtpguard.policy.outbox import Retry, RowState
from smtpguard.replies import Reply
from smtpguard.store import StoreUnavailable
from smtpguard.submission import Principal, Result, Submitter

log = logging.getLogger("smtpguard.outbox")
T = TypeVar("T")

CONCURRENCY = 16
"""Rows of one batch submitted at once: enough to keep a provider pool busy."""
RECONNECT_MAX = 5.0
ANSWER_MIN = 5.0
"""No statement is given up sooner (see _answered), whatever the lease."""
COUNT_EVERY = 1.0
"""The rows-per-state gauges are refreshed at most this often."""
WHOLE_EVERY_ROWS = 100_000
WHOLE_EVERY = 60.0
"""A table holding WHOLE_EVERY_ROWS rows or more has its final states counted at most this
often: that count reads every row (a million rows: 868 MB, 300 ms), where the open states
are read through the partial index at every refresh."""


@dataclass(slots=True)
class Counters:
    passes: int = 0
    polls: int = 0
    """Passes started because `poll` ran out, not by a notification (tests read it)."""
    notified: int = 0
    reconnects: int = 0
    """Connections made, the first one included."""
    outages: int = 0
    """Times the database was found gone."""
    rows: int = 0
    """Rows claimed and handled by this reader."""


@dataclass(eq=False, repr=False)
class OutboxReader:
    name: str
    src: OutboxSource
    password: str | None
    submitter: Submitter
    clock: Callable[[], float]
    on_result: Callable[[Principal, Result], None] = lambda p, r: None
    on_counts: Callable[[str, dict[str, int], float | None], None] = lambda s, c, o: None
    checks: Callable[[], EnvelopeChecks | None] = lambda: None
    """The listener's RCPT checks (its Handler: recipient domains, receivers), read per row."""
    rng: random.Random = field(default_factory=random.Random)
    counters: Counters = field(init=False, default_factory=Counters)
    _wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _stopping: bool = field(init=False, default=False)
    _task: asyncio.Task[None] | None = field(init=False, default=None)
    _conn: AsyncConnection[TupleRow] | None = field(init=False, default=None)
    _listener: asyncio.Task[None] | None = field(init=False, default=None)
    _unwritten: dict[int, Written] = field(init=False, default_factory=dict)
    _writing: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    _counted_at: float = field(init=False, default=0.0)
    _whole: dict[str, int] = field(init=False, default_factory=dict)
    """The last count of every state (the final ones are read from it between two)."""
    _whole_at: float = field(init=False, default=0.0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    def serves(self, src: OutboxSource | None, password: str | None) -> bool:
        """True when this reader is the one `src` with `password` needs (a reload keeps it)."""
        return src == self.src and password == self.password

    def halt(self) -> None:
        """No claim and no submission starts from now on (no await: a reload's swap calls
        it): the submissions under way finish, and the claims of the batch's rows not yet
        begun are given back (due at once) for the reader that serves now."""
        self._stopping = True
        self._wake.set()

    async def stop(self, timeout: float) -> None:
        """halt(), then wait (bounded) for the submissions under way and their receipts.
        Rows still claimed past the bound come due again when their claim lapses; the
        ledger answers them."""
        self.halt()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except (TimeoutError, asyncio.CancelledError):
                log.warning(
                    "outbox stopped mid-batch; its claims lapse and return", extra={"source": self.name}
                )
        await self._disconnect()

    # --- connections ---------------------------------------------------------------------
    async def _connect(self) -> None:
        self._conn = await self._answered(connect(self.src.url, self.password))
        listen = await self._answered(connect(self.src.url, self.password))
        try:
            await self._answered(listen.execute(schema.listen(self.src.table)))
        except BaseException:
            with contextlib.suppress(psycopg.Error, OSError):
                await listen.close()
            raise
        self._listener = asyncio.create_task(self._listen(listen))

    async def _listen(self, conn: AsyncConnection[TupleRow]) -> None:
        try:
            async for _ in conn.notifies():
                self.counters.notified += 1
                self._wake.set()
        except psycopg.Error:
            # The database went away: the next pass finds out, and reconnects both.
            self._wake.set()
        finally:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()

    async def _disconnect(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                await self._listener
            self._listener = None
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                await self._conn.close()
            self._conn = None

    async def _answered(self, statement: Awaitable[T]) -> T:
        """`statement` on the source's database, given up when no answer came within the
        claim's lease (at least ANSWER_MIN): a backend that stopped answering (a stuck disk,
        a paused host, a path dropping every packet) keeps a connection open and silent,
        and the reader would wait on it until the kernel gave up, a quarter of an hour, or
        for ever. Given up, it is an outage: the connection is dropped and a new one made.
        A claim whose answer was lost lapses; a receipt not written waits for the next."""
        bound = max(self.submitter.config.event_key.lease, ANSWER_MIN)
        try:
            return await asyncio.wait_for(statement, bound)
        except TimeoutError:
            raise psycopg.OperationalError(f"the outbox database did not answer within {bound:g} s") from None

    def _connected(self) -> bool:
        return (
            self._conn is not None
            and not self._conn.closed
            and self._listener is not None
            and not self._listener.done()
        )

    # --- the loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        delay = 0.2
        polled = False
        while not self._stopping:
            try:
                if not self._connected():
                    await self._disconnect()
                    await self._connect()
                    self.counters.reconnects += 1
                    log.info("outbox connected", extra={"source": self.name, "table": self.src.table})
                await self._flush_unwritten()
                self.counters.passes += 1
                self.counters.polls += polled
                full = await self._pass()
                await self._count()
                delay = 0.2
                if full:
                    polled = False
                    continue
            except (psycopg.Error, OSError) as e:
                self.counters.outages += 1
                log.warning(
                    "outbox database unavailable; reconnecting",
                    extra={"source": self.name, "error": f"{type(e).__name__}: {e}"[:300], "retry_in": delay},
                )
                await self._disconnect()
                await self._sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX)
                polled = False
                continue
            except Exception as e:
                # A defect must not stop serve, nor this source for good.
                log.error(
                    "outbox pass failed",
                    extra={"source": self.name, "error": f"{type(e).__name__}: {e}"[:300]},
                )
                await self._sleep(RECONNECT_MAX)
                continue
            polled = not await self._sleep(self.src.poll)

    async def _sleep(self, seconds: float) -> bool:
        """True when woken (a notification, a stop) before `seconds` ran out."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
            return True
        except TimeoutError:
            return False
        finally:
            self._wake.clear()

    async def _pass(self) -> bool:
        """One claim and its rows; True when more rows were due than it took (its batch was
        full, or its octet bound reached): the next pass starts at once."""
        assert self._conn is not None
        now = self.clock()
        until = now + self.submitter.config.event_key.lease
        limit = self.submitter.config.limits.max_message_size
        claim = await self._answered(
            rows.claim(self._conn, self.src.table, now, until, self.src.batch, limit)
        )
        claimed = claim.rows
        if not claimed:
            return False
        turns = asyncio.Semaphore(CONCURRENCY)
        unbegun: list[Row] = []

        async def one(row: Row) -> None:
            if row.id in self._unwritten:
                # Claimed again while its receipt waits (for the database, or a lock the
                # application holds on the row): that receipt is the answer, not a resend.
                return
            async with turns:
                if self._stopping:
                    unbegun.append(row)
                    return
                written = await self._handle(row)
            self._unwritten[row.id] = written
            # The database may have gone meanwhile: the receipt waits for it (below).
            with contextlib.suppress(psycopg.Error, OSError):
                await self._flush_unwritten()

        await asyncio.gather(*(one(r) for r in claimed))
        self.counters.rows += len(claimed) - len(unbegun)
        await self._flush_unwritten()
        if unbegun:
            # Halted (a reload, a stop): the claims of rows never submitted are given back
            # for the reader that serves now, rather than left to lapse a lease later.
            await self._answered(rows.release(self._conn, self.src.table, unbegun))
        return claim.more

    async def _flush_unwritten(self) -> None:
        """Write every receipt waiting, in one transaction. Rows that finish while one
        flush runs wait for the lock and go together in the next: a group commit. A receipt
        whose row the application holds locked stays for a later flush."""
        async with self._writing:
            batch = dict(self._unwritten)
            if not batch:
                return
            assert self._conn is not None
            locked = await self._answered(rows.write(self._conn, self.src.table, batch, self.clock()))
            for row_id, w in batch.items():
                if row_id not in locked and self._unwritten.get(row_id) is w:
                    del self._unwritten[row_id]

    async def _count(self) -> None:
        now = self.clock()
        if now - self._counted_at < COUNT_EVERY:
            return
        assert self._conn is not None
        # The final states are counted by reading every row of the table: on a large one,
        # only now and then; the open ones (and the lag) at every refresh, by the index.
        whole = sum(self._whole.values()) < WHOLE_EVERY_ROWS or now - self._whole_at >= WHOLE_EVERY
        counts, oldest = await self._answered(rows.counts(self._conn, self.src.table, whole))
        if whole:
            self._whole, self._whole_at = counts, now
        else:
            counts = {**self._whole, **counts}
        self._counted_at = now
        self.on_counts(self.name, counts, None if oldest is None else max(now - oldest, 0.0))

    # --- one row -------------------------------------------------------------------------
    async def _handle(self, row: Row) -> Written:
        if row.problem is not None:
            reply = replies.malformed_message(f"the row could not be read ({row.problem})")
            return Written(RowState.FAILED, str(reply), None, None, None, True, row.event_key)
        if row.sg_id is not None:
            followed = await self._follow(row)
            if followed is not None:
                return followed
        principal, result = await submit_row(
            self.submitter,
            self.name,
            self.src,
            row.event_key,
            row.message,
            row.size,
            row.mail_from,
            row.rcpt_to,
            self.checks(),
        )
        self.on_result(principal, result)
        now = self.clock()
        r = policy.receipt(
            result.decision,
            result.reply,
            now,
            policy.became_due(row.created_at, row.not_before),
            self._max_age(row) if result.reply.temporary else float("inf"),
            row.attempts,
            self._retry(),
            self.rng.random(),
        )
        keep = r.follow or r.done
        return Written(
            r.state,
            str(result.reply),
            result.sg_id if keep else None,
            result.upstream_id if r.state is RowState.SENT else None,
            r.next_attempt_at,
            r.done,
            row.event_key,
        )

    async def _follow(self, row: Row) -> Written | None:
        """A row whose own submission is its record's (held, or queued): the record says
        what became of it. None: submit the row again (the ledger decides)."""
        try:
            record = await self.submitter.store.get(self.src.zone, row.event_key)
        except StoreUnavailable:
            return self._waiting(row)
        state = policy.settled(record.state.value if record is not None else None)
        if state is RowState.PENDING:
            return None
        assert record is not None
        if not policy.is_records_message(
            row.message, row.mail_from, row.rcpt_to, self.submitter.config.limits.headers, record.fingerprint
        ):
            return None
        if state is None:
            return self._waiting(row)
        by = next((e.actor for e in reversed(record.audit) if e.to_state == "delivered"), "an operator")
        sg_id = record.sg_id or row.sg_id or ""
        settled = policy.settled_reply(state, record.reply, sg_id, record.upstream_id, by)
        reply = str(settled) if settled is not None else None
        return Written(state, reply, row.sg_id, record.upstream_id, None, True, row.event_key)

    def _waiting(self, row: Row) -> Written:
        """A followed row whose record is not settled yet: looked at again in a while."""
        due = self.clock() + self._retry().follow_every
        return Written(row.state, None, row.sg_id, None, due, False, row.event_key)

    def _retry(self) -> Retry:
        config = self.submitter.config
        b = config.queue.backoff
        follow = config.verdicts.every if config.verdicts is not None else 60.0
        return Retry(b.base, b.max, config.event_key.min_retry_interval, min(follow, 60.0))

    def _max_age(self, row: Row) -> float:
        """The max_age of the row's message class (its class header, else the zone's or the
        queue's default class), as a queued message of that class would have."""
        config = self.submitter.config
        q = config.queue
        zone = config.zones.get(self.src.zone)
        default = zone.default_class if zone is not None else None
        parsed = parse(policy.wire_form(row.message), self.submitter.config.limits.headers)
        names = (
            [] if isinstance(parsed, Reply) else class_names(parsed, q.class_header, default, q.default_class)
        )
        for name in names:
            if name in q.classes:
                return q.classes[name].max_age
        return q.classes[q.default_class].max_age
