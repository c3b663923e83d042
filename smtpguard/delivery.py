"""The store-and-forward worker (DESIGN.md §4a): claims due entries lane by lane and relays
them through the same path as a synchronous submission.

Any instance sharing the store delivers what any instance accepted. A claim is a lease:
an instance killed with `kill -9` gives its claims back when they expire, and the ledger
then decides (before_data: retried; data_sent: unknown, never re-sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace

from smtpguard import class_pauses, replies
from smtpguard.config import Config, ZoneConfig
from smtpguard.ids import new_id
from smtpguard.policy import ledger, queue
from smtpguard.policy.decisions import Decision
from smtpguard.policy.ledger import Submission
from smtpguard.policy.limits import Ending, cap_check, caps_for, unit_fate, user_caps_of
from smtpguard.policy.queue import HOLD_PAUSED as HOLD_PAUSED  # moved to policy/queue.py
from smtpguard.policy.queue import backoff_delay, lane_quotas, queue_due
from smtpguard.receivers import Receivers
from smtpguard.relay import Envelope
from smtpguard.replies import Reply
from smtpguard.store import HELD, Claimed, Store, StoreUnavailable
from smtpguard.submission import Result, Submitter

log = logging.getLogger("smtpguard.delivery")

ORPHAN_SCAN_INTERVAL = 60.0
"""How often the worker looks for lanes that are no longer in queue.classes (a reload
renamed or removed a class while its entries waited); also at start and after a reload."""


class DeliveryWorker:
    def __init__(
        self,
        submitter: Submitter,
        store: Store,
        on_result: Callable[[str, Result], None],
        rng: random.Random | None = None,
    ) -> None:
        self.submitter = submitter
        self.store = store
        self.on_result = on_result
        self.rng = rng or random.Random()
        self._wake = asyncio.Event()
        self._active: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._orphans: set[str] = set()
        """Lanes with entries that no configured class names: served as queue.default_class."""
        self._orphans_seen_at: float | None = None
        self._orphans_for: object = None
        self.receivers: Receivers | None = None
        """Receiving providers (DESIGN.md §21): an entry whose receiver is paused or over its
        max_rate waits; relayed recipients are counted per receiver."""

    @property
    def config(self) -> Config:
        return self.submitter.config

    def wake(self) -> None:
        self._wake.set()

    def lanes(self) -> list[tuple[str, int]]:
        """Every lane to claim from, with its priority: the configured classes, and lanes
        left by a class that a reload renamed or removed, at the default class's priority —
        their entries were accepted with a 250 and must still be delivered (DESIGN.md §11.2)."""
        classes = self.config.queue.classes
        lanes = [(name, c.priority) for name, c in classes.items()]
        default = classes[self.config.queue.default_class].priority
        lanes += [(name, default) for name in sorted(self._orphans - classes.keys())]
        return lanes

    async def _scan_orphans(self) -> None:
        now = time.monotonic()
        fresh = self._orphans_for is self.config
        if fresh and self._orphans_seen_at is not None and now - self._orphans_seen_at < ORPHAN_SCAN_INTERVAL:
            return
        found = await self.store.queue_lanes() - self.config.queue.classes.keys()
        # Marked only once it worked: a failed scan is tried again on the next pass.
        self._orphans_seen_at, self._orphans_for = now, self.config
        for lane in sorted(found - self._orphans):
            log.warning(
                "queued entries in a lane no class names any more; delivering them as the default class",
                extra={"lane": lane, "default_class": self.config.queue.default_class},
            )
        self._orphans = found

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, timeout: float) -> None:
        """Stop claiming; let deliveries in flight finish (bounded). What is left unfinished
        returns to the queue when its claim expires; nothing is lost."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._active:
            _, pending = await asyncio.wait(self._active, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "stopped with deliveries in flight; their claims expire and return",
                    extra={"deliveries": len(pending)},
                )

    async def _run(self) -> None:
        while not self._stopping:
            free = self.config.queue.workers - len(self._active)
            claimed: list[Claimed] = []
            if free > 0:
                try:
                    await self._scan_orphans()
                    lanes = self.lanes()
                    quotas = lane_quotas(free, lanes, [self.rng.random() for _ in range(free)])
                    claimed = await self.store.claim(
                        self.submitter.clock(), quotas, self.config.event_key.lease
                    )
                except StoreUnavailable as e:
                    log.warning("queue claim failed: store unavailable", extra={"error": str(e)})
                except Exception:
                    # The worker must outlive any one bad pass, or the queue silently stops.
                    log.exception("queue claim failed")
            for item in claimed:
                task = asyncio.create_task(self._deliver(item))
                self._active.add(task)
                task.add_done_callback(self._done)
            if claimed and len(claimed) >= free:
                # Full: wait for a slot, not for the poll interval.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.queue.poll_interval)
                continue
            if not claimed:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.queue.poll_interval)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._active.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("delivery failed unexpectedly", exc_info=task.exception())

    async def _deliver(self, item: Claimed) -> None:
        rec = item.record
        store = self.store
        clock = self.submitter.clock
        zone = self.config.zones.get(rec.zone)
        now = clock()
        attempt_id = new_id(now)
        instance = self.submitter.instance
        ek = self.config.event_key
        settings = (
            self.submitter.settings(zone)
            if zone
            else ledger.LedgerSettings(
                ek.min_retry_interval, ek.lease, send_timeout=self.config.send_timeout()
            )
        )
        try:
            verdict = ledger.on_claim(rec, attempt_id, instance, now, settings)
            if isinstance(verdict, ledger.Finish):
                if verdict.decision == "busy":
                    return
                final = verdict.record or rec
                if await self._requeue_stands(final, rec.version):
                    for token in verdict.refund:
                        await self.submitter.refund(rec.zone, token)
                if verdict.record is not None:
                    self.on_result(rec.zone, Result(_reply_of(final), verdict.decision, rec.key))
                return
            taken = verdict.record
            if await store.put(taken, rec.version) is not None:
                return  # someone else moved it first; their write stands
            for token in verdict.refund:
                await self.submitter.refund(rec.zone, token)
            if self.receivers is not None and zone is not None:
                until = await self.receivers.hold_until(rec.zone, rec.key, item.message.recipients)
                if until is not None:
                    await self._hold(taken, attempt_id, until)
                    return
            facts = queue.GateFacts(now, taken.expires_at, zone is not None, class_pauses.HOLD)
            for _ in range(len(queue.Look) + 1):  # each look answers one rung
                step = queue.gate(facts)
                if isinstance(step, queue.Hold):
                    await self._hold(taken, attempt_id, step.until)
                    return
                if isinstance(step, queue.Go):
                    break
                assert zone is not None  # the gate holds an entry of a zone that is gone
                facts = await self._look(step, facts, zone, rec, attempt_id)
            else:
                raise AssertionError("the queue gate asked for more facts than it has rungs")
            assert zone is not None
            backoff = self.config.queue.backoff
            tries = ledger.attempts_of_this_event(rec) + 1
            delay = backoff_delay(tries, backoff.base, backoff.max, self.rng.random())
            msg = item.message
            sub = Submission(
                rec.zone, rec.key, rec.fingerprint, attempt_id, instance, rec.message_id,
                username=rec.username,
            )  # fmt: skip
            env = Envelope(
                rec.zone, rec.key, attempt_id, msg.sender, msg.recipients, msg.content, msg.smtputf8
            )
            result = await self.submitter.relay(taken, env, sub, settings, retry_delay=delay)
            self.on_result(rec.zone, result)
            if self.receivers is not None and result.decision == Decision.RELAYED:
                self.receivers.sent(rec.zone, [r for r in msg.recipients if r not in result.refused])
        except StoreUnavailable as e:
            # The claim expires and the entry returns; the ledger decides what happens then.
            log.warning(
                "delivery interrupted: store unavailable",
                extra={"zone": rec.zone, "event_key": rec.key, "error": str(e)},
            )

    async def _look(
        self, look: queue.Look, facts: queue.GateFacts, zone: ZoneConfig, rec: ledger.Record, attempt_id: str
    ) -> queue.GateFacts:
        """Look up the one fact the gate asks for next."""
        if look is queue.Look.PAUSE:
            return replace(facts, paused=zone.paused or await self.store.is_paused(rec.zone))
        if look is queue.Look.CLASS:
            # This entry's class paused in its zone (DESIGN.md §16): the other classes flow.
            held = rec.lane is not None and await self.submitter.class_pauses.is_paused(rec.zone, rec.lane)
            return replace(facts, class_paused=held)
        if look is queue.Look.THROTTLE:
            until = await self.submitter.route.blocked_until(rec.zone)
            return replace(facts, throttle_looked=True, throttled_until=until)
        caps = caps_for(zone.plan, zone.hourly_cap, zone.monthly_cap)
        # The submitting user's own caps, counted at delivery as the zone's are.
        user_caps = user_caps_of(zone.users, rec.username, caps)
        check = cap_check(rec.zone, caps, attempt_id, facts.now, rec.username, user_caps)
        try:
            cap = await self.store.consume_cap(check)
        except StoreUnavailable:
            # The unit may have been written with only its reply lost. Leaving it to whoever
            # takes the entry over after this claim's lease is not enough: a worker that took
            # it over while this one stalled before the call has already refunded this
            # attempt's token, before the unit existed, and nobody would again (§11.3).
            for token in unit_fate(Ending.RESERVE_UNANSWERED, attempt_id):
                await self.submitter.refund(rec.zone, token)
            raise
        return replace(facts, cap_looked=True, cap=cap)

    async def _requeue_stands(self, final: ledger.Record, expected: int) -> bool:
        """Requeue, and say whether `final` is what the store now holds — also when the
        write's reply was lost (the refunds that follow it must happen exactly then)."""
        try:
            return await self.store.requeue(final, expected, queue_due(final)) is None
        except StoreUnavailable:
            now = await self.store.get(final.zone, final.key)
            if now is None or now != final:
                raise
            return True

    async def _hold(self, rec: ledger.Record, attempt_id: str, until: float) -> None:
        held = ledger.hold(rec, attempt_id, self.submitter.clock(), until)
        if held is not None:
            due = queue_due(held)  # `until`, or the entry's max_age if sooner
            await self.store.requeue(held, rec.version, due if due is not None and due < HELD else HELD)


def _reply_of(rec: ledger.Record) -> Reply:
    if rec.state is ledger.State.EXPIRED:
        return replies.expired(rec.key)
    return replies.outcome_unknown(rec.key)
