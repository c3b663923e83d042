"""The end of DATA: from a received message to one reply (DESIGN.md §2-§4).

Order (DESIGN.md §3): smuggling/size/header checks → event key → ledger lookup (a duplicate
of a delivered event answers 250 even when the zone is paused or capped) → pause → caps →
durable reservation → relay → durable outcome → reply. Each step asks policy/ and applies
what it returns; no decision is taken here that a unit test of policy/ could not see.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from smtpguard import replies
from smtpguard.class_pauses import ClassPauses
from smtpguard.config import Config, ZoneConfig

# ids, leases and settled moved out of this module; the `as` forms keep them importable from here.
from smtpguard.ids import _SUFFIXES as _SUFFIXES
from smtpguard.ids import _refill_suffixes as _refill_suffixes
from smtpguard.ids import new_id as new_id
from smtpguard.leases import LeaseKeeper as LeaseKeeper
from smtpguard.leases import LeaseLost as LeaseLost
from smtpguard.leases import _Held as _Held
from smtpguard.policy import ledger, verp
from smtpguard.policy.admission import Refused, Rules, admit
from smtpguard.policy.classes import class_names
from smtpguard.policy.decisions import Decision, relayed_as
from smtpguard.policy.envelope import distinct_recipients
from smtpguard.policy.eventkey import derived_key
from smtpguard.policy.ledger import LedgerSettings, Phase, Record, Submission
from smtpguard.policy.limits import (
    CapReached,
    Caps,
    Ending,
    cap_check,
    cap_decision,
    cap_reply,
    token_month,
    unit_fate,
)
from smtpguard.policy.message import Message
from smtpguard.policy.outcome import Kind, Outcome, client_reply, is_recipient_unknown
from smtpguard.policy.queue import queue_due
from smtpguard.policy.senders import recipient_tag
from smtpguard.policy.strip import without_headers
from smtpguard.relay import Envelope, Provider, Route
from smtpguard.replies import Reply
from smtpguard.settled import SettledCache as SettledCache
from smtpguard.store import (
    Conflict,
    Paused,
    QueuedMessage,
    Reserved,
    ReserveResult,
    Store,
    StoreUnavailable,
)
from smtpguard.suppression import SuppressionCache
from smtpguard.verp import VerpKey

log = logging.getLogger("smtpguard.decision")
_SETTLE_TRIES = 20
"""Attempts at writing an outcome (about 30 s of back-off): enough to outlast a store
failover, so neither a provider's answer nor a "not sent" is left to read `unknown`."""

WAIT_POLL = 0.05


@dataclass(frozen=True, slots=True)
class Principal:
    """Who submits: the zone and user an AUTH proved, and the session it happened on."""

    zone: str
    username: str
    client_ip: str | None = None
    session: str | None = None
    """The SMTP session's id in the logs: every line about one connection carries it."""
    credential: str | None = field(default=None, repr=False, compare=False)
    """The password hash AUTH matched: a reload that drops it, or moves or removes the
    user, ends the session's rights (listener/handler.py `entitled`). Not in any repr."""


@dataclass(slots=True)
class Result:
    reply: Reply
    decision: str
    key: str | None = None
    provider: str | None = None
    upstream_id: str | None = None
    extra: dict[str, object] = field(default_factory=dict)
    sg_id: str | None = None
    """smtpguard's history id (`[sg:…]` in replies, `history`): the event's record's when one
    answered (a duplicate), else this attempt's."""
    message_id: str | None = None
    refused: tuple[str, ...] = ()
    """Recipients the provider refused while it took the message for the others."""


@dataclass(eq=False, repr=False)
class Submitter:
    config: Config
    store: Store
    route: Route
    instance: str
    hostname: str
    clock: Callable[[], float] = time.time
    verp: VerpKey | None = None
    """With `events.mailbox.domain`: relayed mail's envelope sender carries a token."""
    settled: SettledCache = field(init=False, default_factory=SettledCache)
    leases: LeaseKeeper = field(init=False, default_factory=LeaseKeeper)
    suppressions: SuppressionCache = field(init=False)
    class_pauses: ClassPauses = field(init=False)
    on_enqueue: Callable[[], None] | None = field(init=False, default=None)
    """Called after a store-and-forward acceptance, to wake the local delivery worker."""
    _rules: tuple[Config, Rules] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.suppressions = SuppressionCache(self.store)
        self.class_pauses = ClassPauses(self.store)

    async def submit(
        self,
        principal: Principal,
        mail_from: str,
        rcpt_tos: list[str],
        raw: bytes,
        smtputf8: bool = False,
        held: Sequence[str] = (),
    ) -> Result:
        """`held`: recipients a receiver held at RCPT (DESIGN.md §21), owed by the event."""
        zone = self.config.zones.get(principal.zone)
        if zone is None:
            # The zone was removed by a reload while this session was open.
            return Result(replies.send_as_disabled(principal.zone), Decision.ZONE_GONE)
        attempt_id = new_id(self.clock())
        rcpt_tos = distinct_recipients(rcpt_tos)
        admitted = admit(
            raw,
            mail_from,
            rcpt_tos,
            principal.zone,
            principal.username,
            zone,
            self._admission_rules(),
            attempt_id,
            distinct_recipients([h for h in held if h not in rcpt_tos]),
        )
        if isinstance(admitted, Refused):
            if admitted.key is None:
                return Result(admitted.reply, admitted.decision)
            refused = Result(admitted.reply, admitted.decision, admitted.key, sg_id=attempt_id)
            refused.message_id = admitted.message_id
            return refused
        key, message_id, lane, parsed = admitted.key, admitted.message_id, admitted.lane, admitted.message
        ek = self.config.event_key

        def content() -> bytes:
            # The key headers stop here (a provider's idempotency_header carries the key
            # on): they are smtpguard's business, not the recipient's. Queued mail is stored
            # so. Built only for a message that is sent or queued, in one copy.
            added = admitted.added_header
            return without_headers(raw, ek.headers, added) if ek.strip else added + raw

        def ids(result: Result) -> Result:
            result.sg_id = result.sg_id or attempt_id
            result.message_id = message_id
            return result

        sub = Submission(
            principal.zone,
            key,
            admitted.fingerprint,
            attempt_id,
            self.instance,
            message_id,
            admitted.derived,
            lane,
            admitted.max_age,
            tuple(sorted({recipient_tag(r) for r in rcpt_tos})),
            principal.username,
            # Kept where VERP replaces it on the wire (DESIGN.md §18).
            sender=mail_from if self.verp is not None else None,
            earlier_fingerprint=admitted.earlier_fingerprint,
            owed=admitted.owed,
            accepted_fingerprint=admitted.accepted_fingerprint,
        )
        settings = self.settings(zone)
        try:
            sub = await self._as_recorded_before_owed(sub)
            key = sub.key
            if lane is not None:
                queued = QueuedMessage(
                    mail_from,
                    tuple(rcpt_tos),
                    content(),
                    self.config.queue.classes[lane].priority,
                    smtputf8,
                )
                return ids(await self._accept_queued(sub, zone, settings, queued))
            reserved = await self._reserve(
                sub,
                zone,
                settings,
                paused_class=lambda: self._paused_class(principal.zone, parsed, zone),
                caps=(admitted.caps, admitted.user_caps),
            )
            if isinstance(reserved, Result):
                return ids(reserved)
            env = Envelope(principal.zone, key, attempt_id, mail_from, tuple(rcpt_tos), content(), smtputf8)
            return ids(await self.relay(reserved, env, sub, settings))
        except StoreUnavailable as e:
            log.error(
                "store unavailable; nothing relayed",
                extra={"zone": principal.zone, "event_key": key, "error": str(e)},
            )
            return ids(Result(replies.STORE_UNAVAILABLE, Decision.STORE_UNAVAILABLE, key))

    async def _as_recorded_before_owed(self, sub: Submission) -> Submission:
        """A derived key is the fingerprint, which a release before `owed` took of the
        recipients accepted at RCPT alone: its record of this transaction (a receiver held
        the same recipients) is under that key, and this submission is that event's
        (docs/receivers.md, a rolling upgrade). One read, only for a derived key with
        recipients held."""
        if not sub.derived or sub.accepted_fingerprint is None:
            return sub
        earlier = derived_key(sub.accepted_fingerprint)
        rec = await self.store.get(sub.zone, earlier)
        return replace(sub, key=earlier) if ledger.recorded_before_owed(rec, sub) else sub

    async def _paused_class(self, zone_name: str, parsed: Message, zone: ZoneConfig) -> str | None:
        """Relay mode: the message's class when `pause ZONE --class` holds it (DESIGN.md
        §16). A class header a relay-mode zone never validated is not refused here; but
        any of its values naming a paused class holds the message (a header given twice
        must not slip past a kill switch), and no header means the default class."""
        pairs = await self.class_pauses.paused()
        held = {c for z, c in pairs if z == zone_name}
        if not held:
            return None
        q = self.config.queue
        names = class_names(parsed, q.class_header, zone.default_class, q.default_class)
        return next((name for name in names if name in held), None)

    def _admission_rules(self) -> Rules:
        """Admission's settings, built once per config (a reload swaps the config)."""
        config = self.config
        if self._rules is None or self._rules[0] is not config:
            q = config.queue
            limits = config.limits.headers
            max_ages = {name: c.max_age for name, c in q.classes.items()}
            rules = Rules(
                limits, config.event_key.headers, q.class_header, q.default_class, max_ages, self.hostname
            )
            self._rules = (config, rules)
        return self._rules[1]

    def settings(self, zone: ZoneConfig) -> LedgerSettings:
        ek = self.config.event_key
        return LedgerSettings(ek.min_retry_interval, ek.lease, zone.derive_window, self.config.send_timeout())

    async def refund(self, zone: str, token: str) -> None:
        """Give back the cap unit of an attempt that reached no provider's DATA. Idempotent,
        so it is retried (a few times, briefly) and a refund that lands twice returns one
        unit; a store that stays unreachable keeps the unit, the safe side of a cap."""
        for attempt in range(4):
            try:
                await self.store.refund(zone, token, token_month(token, self.clock()))
                return
            except StoreUnavailable as e:
                if attempt == 3:
                    log.warning(
                        "cap unit not refunded: store unavailable", extra={"zone": zone, "error": str(e)}
                    )
                    return
            await asyncio.sleep(0.05 * 2**attempt)

    async def _refund_all(
        self,
        sub: Submission,
        ending: Ending,
        taken_over: Sequence[str] = (),
        outcome: Outcome | None = None,
        counted: bool = True,
    ) -> None:
        """Give back the units policy says this ending leaves unspent."""
        for token in unit_fate(ending, sub.attempt_id, taken_over, outcome, counted):
            await self.refund(sub.zone, token)

    async def _accept_queued(
        self, sub: Submission, zone: ZoneConfig, s: LedgerSettings, message: QueuedMessage
    ) -> Result:
        """Store-and-forward: the 250 is given once record and message are durable together.
        Pause and caps are not checked here: they hold the lane at delivery time."""

        async def enqueue(verdict: ledger.Proceed) -> ReserveResult:
            conflict = await self.store.enqueue(verdict.record, verdict.expected_version, message)
            return Reserved() if conflict is None else conflict

        reserved = await self._reserve(sub, zone, s, enqueue)
        if isinstance(reserved, Result):
            return reserved
        if self.on_enqueue is not None:
            self.on_enqueue()
        return Result(replies.queued(reserved.queue_id or sub.attempt_id), Decision.QUEUED, sub.key)

    async def _reserve(
        self,
        sub: Submission,
        zone: ZoneConfig,
        s: LedgerSettings,
        write: Callable[[ledger.Proceed], Awaitable[ReserveResult]] | None = None,
        paused_class: Callable[[], Awaitable[str | None]] | None = None,
        caps: tuple[Caps, Caps | None] | None = None,
    ) -> Record | Result:
        """Decide and reserve until one verdict sticks. Optimistic: assume the key is new,
        so a new key and a duplicate each cost one store round trip. A paused class forces
        the reservation's pause, which comes after its version check; and the paused
        classes are only looked up once the ledger says the message would be sent, so a
        duplicate of a delivered event still answers 250 — from the settled cache even
        while the store is down (DESIGN.md §3 order)."""
        deadline = self.clock() + self.config.event_key.inflight_wait
        current = self.settled.get(sub.zone, sub.key, self.clock(), self.config.event_key.retention)
        cached = current is not None
        for _ in range(1000):
            now = self.clock()
            self.settled.remember(current)
            verdict = ledger.decide(current, sub, now, s)
            if isinstance(verdict, ledger.Answer):
                return Result(
                    verdict.reply, verdict.decision, sub.key, sg_id=current.sg_id if current else None
                )
            if cached:
                # The cache answers duplicates only: its copies carry no history, and a
                # write (a derived key's new event) must start from the stored record.
                cached = False
                current = await self.store.get(sub.zone, sub.key)
                continue
            if isinstance(verdict, ledger.Wait):
                if now >= deadline:
                    return Result(replies.in_flight(sub.key), Decision.IN_FLIGHT, sub.key)
                await asyncio.sleep(WAIT_POLL)
                current = await self.store.get(sub.zone, sub.key)
                continue
            if isinstance(verdict, ledger.Transition):
                conflict = await self.store.put(verdict.record, verdict.expected_version)
                if conflict is None:
                    return Result(verdict.reply, verdict.decision, sub.key)
                current = conflict.current
                continue
            held = await paused_class() if paused_class is not None and write is None else None
            try:
                if write is not None:
                    result = await write(verdict)
                else:
                    # Relay mode's reservation counts the caps admission named (DESIGN.md §3).
                    assert caps is not None, "a reservation without a write counts caps"
                    cap = cap_check(sub.zone, caps[0], sub.attempt_id, now, sub.username, caps[1])
                    result = await self.store.reserve(
                        verdict.record, verdict.expected_version, cap, zone.paused or held is not None
                    )
            except StoreUnavailable:
                # The reservation may have run with only its reply lost. Its unit goes back
                # now; if the write stands, the record is ours.
                await self._refund_all(sub, Ending.RESERVE_UNANSWERED, counted=write is None)
                raise
            if isinstance(result, Reserved):
                await self._refund_all(sub, Ending.RESERVED, verdict.refund)
                return verdict.record
            if isinstance(result, Conflict):
                current = result.current
                if (
                    current is not None
                    and current.sg_id == sub.attempt_id
                    and current.version == verdict.record.version
                ):
                    # Our own write landed and only its reply was lost (a retried script
                    # after a connection reset): the reservation is ours.
                    await self._refund_all(sub, Ending.RESERVED, verdict.refund)
                    return current
                continue
            if isinstance(result, Paused):
                if held is not None:
                    return Result(replies.class_paused(sub.zone, held), Decision.PAUSED, sub.key)
                return Result(replies.paused(sub.zone), Decision.PAUSED, sub.key)
            assert isinstance(result, CapReached)
            return Result(cap_reply(sub.zone, result), cap_decision(result), sub.key)
        return Result(replies.in_flight(sub.key), Decision.CONTENDED, sub.key)

    async def relay(
        self,
        rec: Record,
        env: Envelope,
        sub: Submission,
        s: LedgerSettings,
        retry_delay: float | None = None,
    ) -> Result:
        """Relay a reserved record (owned, in_flight, before_data) and write its outcome.
        Used for synchronous submissions and by the store-and-forward worker alike."""
        lock = asyncio.Lock()
        state = {"rec": rec}

        async def write(change: Callable[[Record], Record | None]) -> None:
            async with lock:
                current = state["rec"]
                new = change(current)
                if new is None:
                    raise LeaseLost()
                conflict = await self.store.put(new, current.version)
                if conflict is not None:
                    raise LeaseLost()
                state["rec"] = new

        async def before_data(p: Provider) -> None:
            await write(
                lambda r: ledger.mark_data_sent(
                    r, sub.attempt_id, self.clock(), s, p.name, p.event_tag, p.log
                )
            )

        async def renew() -> None:
            await write(lambda r: ledger.renew_lease(r, sub.attempt_id, self.clock(), s))

        if self.verp is not None and env.sender:
            # Every provider of the route (failover and standby too) sends with the token,
            # so a report about this attempt can prove it is one (DESIGN.md §18). A null
            # sender (<>, a message that must never be bounced) stays null.
            env = replace(env, sender=verp.sender(self.verp.secret, sub.attempt_id, self.verp.domain))
        held = self.leases.hold(renew, s.lease)
        try:
            outcome = await self.route.send(env, before_data)
        except ledger.MaxAgeReached:
            # Stopped before DATA by the entry's max_age (DESIGN.md §4a: never sent after
            # it): expired, and its unit back. Unwritten (the store away), the claim's lease
            # runs out before_data and the next claim expires it.
            self.leases.release(held)
            claimed = state["rec"]
            await self._give_back(claimed, lambda now: ledger.expire(claimed, sub.attempt_id, now))
            await self._refund_all(sub, Ending.EXPIRED)
            return Result(replies.expired(sub.key), Decision.EXPIRED, sub.key, sg_id=sub.attempt_id)
        except (LeaseLost, StoreUnavailable) as e:
            # Stopped before DATA: nothing reached a provider, so the cap unit goes back.
            if isinstance(e, LeaseLost):
                await self._refund_all(sub, Ending.LEASE_LOST)
                return Result(replies.in_flight(sub.key), Decision.LEASE_LOST, sub.key)
            # The data_sent note (or a renewal) may have landed with only its reply lost:
            # left so, the event would read `unknown` after its lease though no DATA was
            # sent (DESIGN.md §11.6, §18). "Not sent" is written first, with a 250's retry
            # budget (a store failover takes seconds, and the refund's own retries came
            # first and ate them), then the unit goes back.
            unsent = Outcome(Kind.UNAVAILABLE, None, detail=f"store: {e}"[:200], data_sent=False)
            self.leases.release(held)
            await self._settle(state["rec"], sub, unsent, s, retry_delay)
            await self._refund_all(sub, Ending.STORE_LOST)
            raise
        except Exception as e:
            # A defect, not an SMTP outcome (providers translate every SMTP and OS error).
            # Until the data_sent note stands no DATA can have started: unavailable and
            # refunded (DESIGN.md §11.6). After it, the dot may have gone: unknown.
            sent = state["rec"].phase is not Phase.BEFORE_DATA
            log.error(
                "relay failed unexpectedly",
                extra={"zone": sub.zone, "event_key": sub.key, "error": f"{type(e).__name__}: {e}"[:300]},
            )
            kind = Kind.UNKNOWN if sent else Kind.UNAVAILABLE
            outcome = Outcome(kind, None, detail=f"internal error: {type(e).__name__}", data_sent=sent)
        finally:
            self.leases.release(held)

        if outcome.wait_until is not None and state["rec"].lane is not None:
            # Queued mail waits for a throttled provider (DESIGN.md §16): held until the
            # route is usable, with no attempt counted (no backoff step, nothing in the
            # history) and its cap unit back; nothing reached any provider's DATA.
            claimed, until = state["rec"], outcome.wait_until
            await self._give_back(claimed, lambda now: ledger.hold(claimed, sub.attempt_id, now, until))
            await self._refund_all(sub, Ending.HELD)
            return Result(
                replies.no_provider(),
                Decision.THROTTLED,
                sub.key,
                sg_id=sub.attempt_id,
                message_id=sub.message_id,
            )
        await self._settle(state["rec"], sub, outcome, s, retry_delay)
        await self._refund_all(sub, Ending.RELAYED, outcome=outcome)
        await self._suppress_bounced(sub.zone, outcome)
        return Result(
            client_reply(outcome, sub.attempt_id),
            relayed_as(outcome.kind),
            sub.key,
            outcome.provider,
            outcome.upstream_id,
            sg_id=sub.attempt_id,
            message_id=sub.message_id,
            refused=tuple(address for address, _ in outcome.rejected),
        )

    async def _settle(
        self,
        rec: Record,
        sub: Submission,
        outcome: Outcome,
        s: LedgerSettings,
        retry_delay: float | None = None,
    ) -> None:
        """Write the outcome durably. The provider has already answered, so this is retried
        rather than abandoned: a lost 250 would later read as `unknown`, never a resend.
        If the record vanished meanwhile (a Redis failover or eviction), the outcome is
        written back from the last copy we held, so the next duplicate is still caught."""
        current: Record | None = rec
        for attempt in range(_SETTLE_TRIES):
            if current is None:
                log.warning(
                    "ledger record vanished while relaying; writing its outcome back",
                    extra={"zone": sub.zone, "event_key": sub.key},
                )
            base = current or rec
            new = ledger.settle(
                base, sub.attempt_id, self.instance, outcome, self.clock(), s, sub.message_id, retry_delay
            )
            try:
                if new.lane is not None and current is not None:
                    conflict = await self.store.requeue(new, current.version, queue_due(new))
                else:
                    conflict = await self.store.put(new, current.version if current else None)
            except StoreUnavailable:
                await asyncio.sleep(min(0.05 * 2**attempt, 2.0))
                continue
            if conflict is None:
                self.settled.remember(new)
                return
            current = conflict.current
        log.error(
            "could not record outcome; the key will read as unknown after its lease",
            extra={"zone": sub.zone, "event_key": sub.key, "outcome": outcome.kind.value},
        )

    async def _give_back(self, rec: Record, change: Callable[[float], Record | None]) -> None:
        """Give a claimed queue entry back unsent, as `change` (at the time) makes it: held
        until later, or expired. Retried briefly, then left to its claim's lease like any
        interrupted delivery."""
        for attempt in range(4):
            changed = change(self.clock())
            if changed is None:
                return
            try:
                await self.store.requeue(changed, rec.version, queue_due(changed))
                return
            except StoreUnavailable:
                await asyncio.sleep(0.05 * 2**attempt)

    async def _suppress_bounced(self, zone: str, outcome: Outcome) -> None:
        # Only once the event is final: a deferred event is retried, and a retry that lost
        # a recipient to a fresh suppression would no longer be the same message (its
        # fingerprint covers the recipients) and would be refused as a reused key.
        if outcome.kind not in (Kind.DELIVERED, Kind.FAILED):
            return
        now = self.clock()
        for address, reply in outcome.rejected:
            if is_recipient_unknown(reply):
                with contextlib.suppress(StoreUnavailable):
                    await self.store.suppress_add(
                        zone,
                        address,
                        f"upstream {reply.code} {reply.enhanced} {reply.text}"[:300],
                        now,
                    )
                self.suppressions.invalidate(zone)
