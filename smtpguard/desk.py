"""The operator's operations, one code path for the CLI and the console (§14, §16): changes
to a record, pausing a zone or one of its classes, suppression lists and the zone stats.
Every change is audited under the actor the caller names (`cli:USER@HOST`,
`console:USERNAME`); every time is the store's clock (store.now()), so instances and
operators on other machines agree on it.

A decision on a held record is taken once. The store's compare-and-swap decides, not the
page: a console page carries the version of the record it showed, and a decision made on a
stale page finds another version and is refused naming who decided and when. The CLI acts
on the record as it is now (no version), so `resolve` after someone else's resolve is
refused by the ledger's own rule (the record is no longer unknown) and says who did it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from smtpguard import class_pauses
from smtpguard.config import Config, ZoneConfig
from smtpguard.policy import decisions, ledger, receivers
from smtpguard.policy.ledger import AuditEntry, Record, State
from smtpguard.policy.limits import Caps, caps_for, month_of, user_caps_for
from smtpguard.policy.queue import queue_due
from smtpguard.policy.utc import iso_z
from smtpguard.store import Store, StoreUnavailable
from smtpguard.store.base import CapUsage, ZoneAudit

Change = Callable[[Record, float], Record]
_HELD = (State.UNKNOWN, State.FAILED)
log = logging.getLogger("smtpguard.desk")

DECISIONS = ("delivered", "retry", "release")
"""What can be decided on a held record: resolve an `unknown` as delivered or as retry,
release a `failed` one."""


class DeskError(Exception):
    status = 400


class NotFound(DeskError):
    status = 404


class Refused(DeskError):
    """The record's state does not allow it (the ledger's rule says why)."""

    status = 409


def decided_by(decision: AuditEntry) -> str:
    """Who took a decision and when, as a refusal and the console name them."""
    return f"{decision.actor} at {iso_z(decision.at)}"


class AlreadyDecided(Refused):
    def __init__(self, decision: AuditEntry) -> None:
        self.decision = decision
        verb = "released" if decision.action == "release" else "resolved"
        super().__init__(f"already {verb} by {decided_by(decision)}")


def last_decision(rec: Record) -> AuditEntry | None:
    """The latest operator decision in the record's audit (the entry that noted it), if any."""
    for entry in reversed(rec.audit):
        if _is_decision(entry):
            return entry
    return None


def _is_decision(entry: AuditEntry) -> bool:
    # A verdict (DESIGN.md §19, actor `verdict:PROVIDER` or `verdict:SOURCE`) settles a held
    # record as an operator would: it is shown, and refuses a stale page, the same way.
    return entry.action.startswith(("resolve:", "verdict:")) or entry.action == "release"


def decision_change(action: str, actor: str, force: bool = False) -> Change:
    if action in ("delivered", "retry"):
        return lambda r, now: ledger.resolve(r, action, actor, now, force)
    if action == "release":
        return lambda r, now: ledger.release(r, actor, now, force)
    raise DeskError(f"unknown decision {action!r}: one of {', '.join(DECISIONS)}")


async def change_record(
    store: Store,
    zone: str,
    key: str,
    change: Change,
    actor: str,
    action: str,
    expected_version: int | None = None,
) -> Record:
    """Apply an operator's change by compare-and-swap, then note it in the zone's audit.
    With `expected_version` (a page's), any other version is a stale page: refused."""
    for _ in range(10):
        rec = await store.get(zone, key)
        if rec is None:
            raise NotFound(f"no record for zone {zone} key {key!r}")
        if expected_version is not None and rec.version != expected_version:
            decided = last_decision(rec)
            if decided is not None and rec.state not in _HELD:
                raise AlreadyDecided(decided)
            # Still held (or never decided): an older decision is not the news; the page is.
            raise Refused(f"the record changed since this page was shown (now {rec.state.value}); reload it")
        now = store.now()
        try:
            new = change(rec, now)
        except ledger.OperatorRefused as e:
            decided = last_decision(rec)
            if decided is not None and rec.state not in _HELD:
                raise AlreadyDecided(decided) from None
            raise Refused(str(e)) from None
        if rec.lane is not None:
            # Store-and-forward: the queue entry moves with the record, atomically.
            written = await store.requeue(new, rec.version, queue_due(new))
        else:
            written = await store.put(new, rec.version)
        if written is None:
            try:
                await store.audit_add(zone, ZoneAudit(now, actor, action, key))
            except StoreUnavailable as e:
                # The change is made and the record's own audit holds it; only the zone's
                # list of decisions misses it. Not worth telling the operator it failed.
                log.warning(
                    "zone audit not written",
                    extra={"zone": zone, "event_key": key, "action": action, "error": str(e)},
                )
            return new
        if expected_version is not None:
            continue  # re-read: the winner's decision is what the refusal names
    raise Refused("the record kept changing; try again")


async def decide(
    store: Store,
    zone: str,
    key: str,
    action: str,
    actor: str,
    expected_version: int | None,
    force: bool = False,
) -> Record:
    return await change_record(
        store, zone, key, decision_change(action, actor, force), actor, f"decide:{action}", expected_version
    )


# --- zones: pause, suppression, stats -------------------------------------------------------
async def audit(store: Store, zone: str, actor: str, action: str, key: str = "", note: str = "") -> None:
    await store.audit_add(zone, ZoneAudit(store.now(), actor, action, key, note))


async def set_zone_paused(store: Store, zone: str, paused: bool, actor: str) -> None:
    """Pause or resume a zone on every instance at once (they read the store)."""
    await store.set_paused(zone, paused)
    await audit(store, zone, actor, "pause" if paused else "resume")


async def set_class_paused(store: Store, zone: str, message_class: str, paused: bool, actor: str) -> None:
    """DESIGN.md §16: one class of the zone held on every instance within a second."""
    await store.set_class_paused(zone, message_class, paused)
    await audit(store, zone, actor, "pause:class" if paused else "resume:class", message_class)
    if not paused:
        await _wake_after_resume(store, zone, message_class)


async def _wake_after_resume(store: Store, zone: str, message_class: str | None) -> None:
    # Queued entries held while paused come back now, not when their hold ends; once more
    # after every instance has read the resume, for an entry an instance held on its last
    # look at the pause.
    await class_pauses.wake_held(store, zone, message_class, store.now())
    await asyncio.sleep(class_pauses.REFRESH * 2)
    await class_pauses.wake_held(store, zone, message_class, store.now())


async def set_receiver_paused(store: Store, zone: str, receiver: str, paused: bool, actor: str) -> None:
    """DESIGN.md §21: a receiving provider's recipients of the zone held on every instance
    within a second, kept beside the class pauses (policy/receivers.py)."""
    await store.set_class_paused(zone, receivers.control_name(receiver), paused)
    await audit(store, zone, actor, "pause:receiver" if paused else "resume:receiver", receiver)
    if not paused:
        # The receiver's entries may sit in any lane: every held entry of the zone due within
        # the hold is woken (one that is held for another reason is held again at its claim).
        await _wake_after_resume(store, zone, None)


async def set_receiver_slowed(store: Store, zone: str, receiver: str, slowed: bool, actor: str) -> None:
    """`on_alert: slow` begun or ended for a receiver of the zone (DESIGN.md §21): read by
    every worker and instance within a second, as a pause is; audited."""
    control = receivers.slow_control(receiver)
    if ((zone, control) in await store.paused_classes()) == slowed:
        return  # as it is (a judge's first look after a start): nothing to write or audit
    await store.set_class_paused(zone, control, slowed)
    await audit(store, zone, actor, "slow:receiver" if slowed else "end-slow:receiver", receiver)


def split_controls(pairs: set[tuple[str, str]], zone: str) -> tuple[list[str], list[str]]:
    """The zone's paused (classes, receivers), from the store's controls."""
    classes: list[str] = []
    held: list[str] = []
    for pz, name in pairs:
        if pz != zone or receivers.is_slow_control(name):
            continue
        receiver = receivers.receiver_of_control(name)
        (classes if receiver is None else held).append(name if receiver is None else receiver)
    return sorted(classes), sorted(held)


def paused_receivers(pairs: set[tuple[str, str]], name: str, zone: ZoneConfig) -> list[str]:
    """The zone's receivers held by the config or through the store (DESIGN.md §21)."""
    return sorted({*split_controls(pairs, name)[1], *(r for r, s in zone.receivers.items() if s.paused)})


async def suppress_add(
    store: Store, zone: str, address: str, reason: str, actor: str, note: str = ""
) -> bool:
    """List `address` (already normalised); audited even when it was listed: the operator
    asked. True when it was not listed before."""
    added = await store.suppress_add(zone, address, reason, store.now())
    await audit(store, zone, actor, "suppress:add", address, note)
    return added


async def suppress_remove(store: Store, zone: str, address: str, actor: str) -> bool:
    """Take `address` off the list; audited only when it was on it."""
    removed = await store.suppress_remove(zone, address)
    if removed:
        await audit(store, zone, actor, "suppress:remove", address)
    return removed


async def suppress_import(
    store: Store, zone: str, rows: Sequence[tuple[str, str]], actor: str, source: str
) -> int:
    """List every (address, reason) row, all at one time; one audit entry names the file.
    Returns how many were new."""
    now = store.now()
    n = 0
    for addr, reason in rows:
        n += await store.suppress_add(zone, addr, reason, now)
    await audit(store, zone, actor, "suppress:import", "", f"{n} new of {len(rows)} from {source}")
    return n


_HELD_COUNTS = frozenset(
    decisions.stat_name(d)
    for d in (
        decisions.Decision.PAUSED,
        decisions.Decision.CAP_HOUR,
        decisions.Decision.CAP_MONTH,
        decisions.Decision.USER_CAP_HOUR,
        decisions.Decision.USER_CAP_MONTH,
        decisions.Decision.IN_FLIGHT,
        decisions.Decision.TOO_SOON,
        decisions.Decision.FAILED_HELD,
        decisions.Decision.UNKNOWN_HELD,
        decisions.Decision.REUSED,
    )
)
"""The stat names of decisions that held an event back (`stats`' "held")."""


async def zone_paused(store: Store, name: str, zone: ZoneConfig) -> bool:
    """Paused by the config or through the store."""
    return zone.paused or await store.is_paused(name)


async def cap_use(store: Store, name: str, zone: ZoneConfig, now: float) -> tuple[Caps, CapUsage]:
    """The zone's caps and its use of them at `now`."""
    caps = caps_for(zone.plan, zone.hourly_cap, zone.monthly_cap)
    return caps, await store.cap_usage(name, now, month_of(now))


async def zone_stats(config: Config, store: Store, zones: Sequence[str]) -> list[dict[str, Any]]:
    """Each zone's totals, held counts, live cap use (its own and its users'), pauses,
    queue depth per class, suppression count and route: one `stats --json` row each."""
    now = store.now()
    paused_classes = await store.paused_classes()
    depth: dict[str, dict[str, int]] = {}
    for e in await store.queue_entries(None):
        lane = depth.setdefault(e.zone, {})
        lane[e.lane] = lane.get(e.lane, 0) + 1
    out = []
    for z in zones:
        zc = config.zones[z]
        caps, usage = await cap_use(store, z, zc, now)
        counts = await store.counts(z)
        capped = [u.username for u in zc.users if u.hourly_cap is not None or u.monthly_cap is not None]
        users = await store.user_cap_usage(z, capped, now, month_of(now))
        out.append(
            {
                "zone": z,
                "sent": counts.get("sent", 0),
                "duplicates": counts.get("duplicate", 0),
                "deferred": counts.get("deferred", 0),
                "failed": counts.get("failed", 0),
                "unknown": counts.get("unknown", 0),
                "rejected": {
                    k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("rejected:")
                },
                "held": {k: v for k, v in sorted(counts.items()) if k in _HELD_COUNTS},
                "cap": {
                    "hour": {"used": usage.hour, "limit": caps.hourly},
                    "month": {"used": usage.month, "limit": caps.monthly},
                },
                "user_caps": _user_caps(zc, caps, users),
                "paused": await zone_paused(store, z, zc),
                "paused_classes": split_controls(paused_classes, z)[0],
                # DESIGN.md §21: per receiving provider, its counts and whether it is held
                "receivers": receivers.receiver_counts(counts),
                "paused_receivers": paused_receivers(paused_classes, z, zc),
                "queue": depth.get(z, {}),
                "suppressed": len(await store.suppress_list(z)),
                # DESIGN.md §16: the zone's own route, else the top-level one
                "route": zc.providers or [p.name for p in config.providers],
            }
        )
    return out


def _user_caps(zc: ZoneConfig, caps: Caps, usage: dict[str, CapUsage]) -> list[dict[str, Any]]:
    """Each user with caps of its own (DESIGN.md §16): its use of them now."""
    out = []
    for user in zc.users:
        own = user_caps_for(caps, user.hourly_cap, user.monthly_cap)
        if own is None:
            continue
        used = usage.get(user.username, CapUsage(0, 0))
        out.append(
            {
                "username": user.username,
                "hour": {"used": used.hour, "limit": own.hourly},
                "month": {"used": used.month, "limit": own.monthly},
            }
        )
    return out


async def provider_stats(store: Store) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Each instance's circuit per provider with its last probe, and the providers every
    instance keeps off after a rate-limit reply (DESIGN.md §12, §16), with times as epochs."""
    probes = {(p.instance, p.provider): p for p in await store.probes()}
    circuits = []
    for c in await store.circuits():
        probe = probes.get((c.instance, c.provider))
        circuits.append(
            {
                "instance": c.instance,
                "provider": c.provider,
                "circuit": c.circuit,
                "since": c.at,
                # DESIGN.md §12: the last probe's verdict; null when the provider is not probed
                "ready": probe.ready if probe else None,
                "probe": probe.detail if probe else None,
                "probed_at": probe.at if probe else None,
            }
        )
    return circuits, dict(sorted((await store.throttled(store.now())).items()))
