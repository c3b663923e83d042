"""What each console page shows, gathered from the config and the store. No HTTP here:
app.py turns requests into these calls and their results into pages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smtpguard.config import Config
from smtpguard.desk import cap_use, decided_by, last_decision, paused_receivers, split_controls, zone_paused
from smtpguard.policy.ledger import AuditEntry, Record, State
from smtpguard.policy.receivers import receiver_counts
from smtpguard.policy.utc import iso_z
from smtpguard.store import Store

HELD = (State.UNKNOWN.value, State.FAILED.value)
DECIDED_SHOWN_FOR = 24 * 3600.0
"""A decided record stays on /decisions this long, with who decided it."""
LIST_LIMIT = 200
"""Records per state and zone on a page; the page says when there are more."""
AUDIT_READ = 10_000


def iso(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    try:
        return iso_z(epoch)
    except (OverflowError, ValueError, OSError):
        # A time stored before events refused implausible ones (`1e400`): shown, not a 500.
        return f"invalid time ({epoch!r})"


@dataclass
class Bar:
    used: int
    limit: int

    @property
    def percent(self) -> int:
        return 100 if self.limit <= 0 else min(100, round(100 * self.used / self.limit))


@dataclass
class ZoneRow:
    name: str
    counts: dict[str, int]
    hour: Bar
    month: Bar
    paused: bool
    paused_by_config: bool
    paused_classes: tuple[str, ...] = ()
    """Message classes held by `pause ZONE --class` (DESIGN.md §16)."""
    receivers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Sends and provider events per receiving provider (DESIGN.md §21)."""
    paused_receivers: tuple[str, ...] = ()


async def zones(config: Config, store: Store) -> list[ZoneRow]:
    now = store.now()
    classes = await store.paused_classes()
    rows = []
    for name, zone in sorted(config.zones.items()):
        caps, usage = await cap_use(store, name, zone, now)
        rows.append(
            ZoneRow(
                name,
                await store.state_counts(name),
                Bar(usage.hour, caps.hourly),
                Bar(usage.month, caps.monthly),
                await zone_paused(store, name, zone),
                zone.paused,
                tuple(split_controls(classes, name)[0]),
                receiver_counts(await store.counts(name)),
                tuple(paused_receivers(classes, name, zone)),
            )
        )
    return rows


@dataclass
class HeldRow:
    record: Record
    decision: AuditEntry | None
    """The latest decision on it; when the record is no longer held, the one that closed it."""

    @property
    def open(self) -> bool:
        return self.record.state.value in HELD

    @property
    def actions(self) -> tuple[str, ...]:
        if self.record.state is State.UNKNOWN:
            return ("delivered", "retry")
        if self.record.state is State.FAILED:
            return ("release",)
        return ()

    @property
    def reply(self) -> str:
        r = self.record.reply
        return f"{r.code} {r.enhanced} {r.text}" if r else ""


async def held_counts(config: Config, store: Store) -> dict[str, int]:
    """Held records per zone, when more than a page shows."""
    out = {}
    for zone in sorted(config.zones):
        counts = await store.state_counts(zone)
        held = sum(counts.get(st, 0) for st in HELD)
        if held > LIST_LIMIT:
            out[zone] = held
    return out


async def decisions(config: Config, store: Store) -> list[HeldRow]:
    """Every held record, and every one decided in the last day, newest first."""
    now = store.now()
    seen: dict[tuple[str, str], HeldRow] = {}
    for zone in sorted(config.zones):
        for state in HELD:
            for rec in await store.list_records(zone, state, None, None, LIST_LIMIT):
                seen[(zone, rec.key)] = HeldRow(rec, last_decision(rec))
        for entry in await store.audit_log(zone, now - DECIDED_SHOWN_FOR, AUDIT_READ):
            # An operator's decision, or a provider's verdict (§19) taken like one.
            if not entry.action.startswith(("decide:", "verdict:")) or (zone, entry.key) in seen:
                continue
            decided = await store.get(zone, entry.key)
            if decided is not None:
                seen[(zone, entry.key)] = HeldRow(decided, last_decision(decided))
    return sorted(seen.values(), key=lambda row: row.record.updated_at, reverse=True)


@dataclass
class Moment:
    at: float
    kind: str
    """attempt | audit | event"""
    title: str
    detail: str = ""
    css: str = ""

    @property
    def when(self) -> str:
        return iso(self.at)


@dataclass
class History:
    record: Record
    moments: list[Moment] = field(default_factory=list)
    row: HeldRow | None = None


async def history(store: Store, zone: str, key: str) -> History | None:
    rec = await store.get(zone, key)
    if rec is None:
        return None
    moments = []
    for a in rec.attempts:
        code = f"{a.code} {a.enhanced} " if a.code else ""
        moments.append(
            Moment(
                a.at,
                "attempt",
                f"attempt via {a.provider or '-'}: {a.outcome}",
                f"{code}{a.text} [{a.phase}] on {a.instance}",
                "bad" if a.outcome in ("failed", "unknown") else ("ok" if a.outcome == "delivered" else ""),
            )
        )
    for e in rec.audit:
        moments.append(
            Moment(e.at, "audit", f"{e.action} by {e.actor}", f"{e.from_state} → {e.to_state} {e.note}")
        )
    for ev in await store.provider_events(zone, key):
        status = f" {ev.status}" if ev.status else ""
        moments.append(
            Moment(
                ev.at,
                "event",
                f"{ev.type} from {ev.source}{status}",
                f"{ev.recipient or '-'}: {ev.effect} ({ev.provider_type})",
                "bad" if ev.effect == "suppressed" else "",
            )
        )
    moments.sort(key=lambda m: m.at)
    return History(rec, moments, HeldRow(rec, last_decision(rec)))


async def records(store: Store, zone: str, state: str | None) -> list[Record]:
    return await store.list_records(zone, state, None, None, LIST_LIMIT)


@dataclass
class LaneRow:
    zone: str
    lane: str
    depth: int
    due: int
    oldest: float | None


async def queue(store: Store) -> list[LaneRow]:
    now = store.now()
    lanes: dict[tuple[str, str], LaneRow] = {}
    for e in await store.queue_entries(None):
        row = lanes.setdefault((e.zone, e.lane), LaneRow(e.zone, e.lane, 0, 0, None))
        row.depth += 1
        if e.due_at is not None and e.due_at <= now and not e.claimed:
            row.due += 1
        if row.oldest is None or e.enqueued_at < row.oldest:
            row.oldest = e.enqueued_at
    return sorted(lanes.values(), key=lambda r: (r.zone, r.lane))


def age(now: float, at: float | None) -> str:
    if at is None:
        return "-"
    seconds = max(0, int(now - at))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def template_globals() -> dict[str, Any]:
    return {"iso": iso, "age": age, "decision": last_decision, "decided_by": decided_by}
