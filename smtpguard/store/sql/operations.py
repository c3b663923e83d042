"""The operations both SQL stores carry out alike, as plans (statements.py) and the reading
of their rows. Written once here; the shared roles (roles.py) hand them to each backend's
runner (store/sqlite/access.py, store/postgres/pool.py).

Provider health (DESIGN.md §6, §12): every instance publishes each provider's circuit and
readiness probe; the console and /metrics read them all, ordered by provider, then instance.
Connection slots (§16) and AUTH failures (§17: the lockout stays global) are counted across
instances.

Zone controls (§5, §16): a zone's pause switch and its classes' pauses, its counters, and
its suppression list (§3: the zone's or the global list refuses at RCPT), with a per-zone
version each change bumps so every instance knows to reload its copy. A user's cap usage and
adding to the counters are each store's own: PostgreSQL takes arrays.

The desk (§13, §14): a provider event is kept once per (zone, source, event id), and only
its first arrival lists its recipient; a webhook nonce is taken once while it lives; records
are found by an id each store keeps its own way, and listed; the operators' actions go to
the zone audit; the queue is listed by entry, lane and depth.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from smtpguard.policy.ledger import Record
from smtpguard.policy.limits import HOUR
from smtpguard.policy.senders import suppression_key
from smtpguard.store.base import (
    HELD,
    CapUsage,
    CircuitState,
    ProbeState,
    QueueEntry,
    StoredEvent,
    Suppression,
    ZoneAudit,
)
from smtpguard.store.sql.statements import Lock, Plan, Script


def set_circuit(instance: str, provider: str, circuit: str, now: float) -> Plan:
    return Plan(
        "INSERT INTO circuits (instance, provider, circuit, at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (instance, provider) DO UPDATE SET circuit = excluded.circuit, at = excluded.at",
        (instance, provider, circuit, now),
    )


CIRCUITS = Plan(
    "SELECT instance, provider, circuit, at FROM circuits ORDER BY provider{bytewise}, instance{bytewise}"
)


def circuits(rows: Iterable[tuple[Any, ...]]) -> list[CircuitState]:
    return [CircuitState(str(i), str(p), str(s), float(t)) for i, p, s, t in rows]


def set_probe(instance: str, provider: str, ready: bool, detail: str, now: float) -> Plan:
    return Plan(
        "INSERT INTO probes (instance, provider, ready, detail, at) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (instance, provider) DO UPDATE SET ready = excluded.ready, "
        "detail = excluded.detail, at = excluded.at",
        (instance, provider, ready, detail, now),
    )


PROBES = Plan("SELECT instance, provider, ready, detail, at FROM probes ORDER BY provider, instance")


def probes(rows: Iterable[tuple[Any, ...]]) -> list[ProbeState]:
    return [ProbeState(i, p, bool(r), d, float(t)) for i, p, r, d, t in rows]


def throttled(now: float) -> Plan:
    return Plan("SELECT provider, until FROM throttles WHERE until > ?", (now,))


def throttles(rows: Iterable[tuple[Any, ...]]) -> dict[str, float]:
    return {str(p): float(u) for p, u in rows}


def hold_connection(provider: str, holder: str, limit: int, until: float, now: float) -> Script[bool]:
    # One provider's slots are taken one at a time: each sees every earlier one.
    yield Lock(f"conn:{provider}")
    yield Plan("DELETE FROM connection_slots WHERE provider = ? AND until <= ?", (provider, now))
    mine = yield Plan(
        "UPDATE connection_slots SET until = ? WHERE provider = ? AND holder = ?", (until, provider, holder)
    )
    if mine.rowcount:
        return True
    held = yield Plan("SELECT count(*) FROM connection_slots WHERE provider = ?", (provider,))
    if int(held.rows[0][0]) >= limit:
        return False
    yield Plan(
        "INSERT INTO connection_slots (provider, holder, until) VALUES (?, ?, ?)", (provider, holder, until)
    )
    return True


def drop_connection(provider: str, holder: str) -> Plan:
    return Plan("DELETE FROM connection_slots WHERE provider = ? AND holder = ?", (provider, holder))


def auth_failure(ip: str, now: float, window: float) -> Script[int]:
    # One address's failures are counted one at a time: each sees every earlier one.
    yield Lock(f"auth:{ip}")
    yield Plan("INSERT INTO auth_failures (ip, at) VALUES (?, ?)", (ip, now))
    counted = yield auth_failures(ip, now, window)
    return int(counted.rows[0][0])


def auth_failures(ip: str, now: float, window: float) -> Plan:
    return Plan("SELECT count(*) FROM auth_failures WHERE ip = ? AND at > ?", (ip, now - window))


def count(rows: list[tuple[Any, ...]]) -> int:
    return int(rows[0][0])


# --- zone controls ---------------------------------------------------------------------------
def set_paused(zone: str, paused: bool) -> Plan:
    if paused:
        return Plan("INSERT INTO paused (zone) VALUES (?) ON CONFLICT DO NOTHING", (zone,))
    return Plan("DELETE FROM paused WHERE zone = ?", (zone,))


def is_paused(zone: str) -> Plan:
    return Plan("SELECT 1 FROM paused WHERE zone = ?", (zone,))


def set_class_paused(zone: str, message_class: str, paused: bool) -> Plan:
    if paused:
        return Plan(
            "INSERT INTO paused_classes (zone, class) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (zone, message_class),
        )
    return Plan("DELETE FROM paused_classes WHERE zone = ? AND class = ?", (zone, message_class))


PAUSED_CLASSES = Plan("SELECT zone, class FROM paused_classes")


def paused_classes(rows: Iterable[tuple[Any, ...]]) -> set[tuple[str, str]]:
    return {(str(z), str(c)) for z, c in rows}


def cap_usage_of(zone: str, now: float, month: str) -> Plan:
    # sum(): PostgreSQL spreads a zone's month over slot rows (store/postgres/rows.py); SQLite
    # keeps one row.
    return Plan(
        "SELECT (SELECT count(*) FROM sends WHERE zone = ? AND at >= ?), "
        "(SELECT sum(used) FROM monthly WHERE zone = ? AND month = ?)",
        (zone, now - HOUR, zone, month),
    )


def cap_usage(rows: list[tuple[Any, ...]]) -> CapUsage:
    hour, month = rows[0]
    return CapUsage(hour=int(hour), month=int(month or 0))


def counters(zone: str) -> Plan:
    return Plan("SELECT name, value FROM counters WHERE zone = ?", (zone,))


def counts(rows: Iterable[tuple[Any, ...]]) -> dict[str, int]:
    return {str(name): int(value) for name, value in rows}


# --- suppression -------------------------------------------------------------------------------
def suppressed(zone: str, address: str) -> Plan:
    # The zone's own listing answers before the global one.
    return Plan(
        "SELECT zone FROM suppression WHERE address = ? AND zone IN (?, 'global') "
        "ORDER BY zone = 'global' LIMIT 1",
        (suppression_key(address), zone),
    )


def listed_in(rows: list[tuple[Any, ...]]) -> str | None:
    return str(rows[0][0]) if rows else None


def suppress_add(zone: str, address: str, reason: str, at: float) -> Script[bool]:
    added = yield Plan(
        "INSERT INTO suppression (zone, address, reason, at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT DO NOTHING RETURNING 1",
        (zone, suppression_key(address), reason, at),
    )
    if added.rows:
        yield bump_supp_version(zone)
    return bool(added.rows)


def suppress_remove(zone: str, address: str) -> Script[bool]:
    gone = yield Plan(
        "DELETE FROM suppression WHERE zone = ? AND address = ? RETURNING 1", (zone, suppression_key(address))
    )
    if gone.rows:
        yield bump_supp_version(zone)
    return bool(gone.rows)


def bump_supp_version(zone: str) -> Plan:
    """Every instance reloads the zone's list on seeing its version move."""
    return Plan(
        "INSERT INTO supp_versions (zone, v) VALUES (?, 1) "
        "ON CONFLICT (zone) DO UPDATE SET v = supp_versions.v + 1",
        (zone,),
    )


def suppress_list(zone: str) -> Plan:
    return Plan(
        "SELECT zone, address, reason, at FROM suppression WHERE zone = ? ORDER BY address{bytewise}", (zone,)
    )


def suppressions(rows: Iterable[tuple[Any, ...]]) -> list[Suppression]:
    return [Suppression(str(z), str(a), str(r), float(t)) for z, a, r, t in rows]


def suppression_versions(zone: str) -> Plan:
    return Plan("SELECT zone, v FROM supp_versions WHERE zone IN (?, 'global')", (zone,))


def versions(rows: Iterable[tuple[Any, ...]], zone: str) -> tuple[int, int]:
    """The zone's list version and the global list's (0: never changed)."""
    got = {str(z): int(v) for z, v in rows}
    return got.get(zone, 0), got.get("global", 0)


# --- provider events and the operator's desk ---------------------------------------------------
def apply_event(zone: str, key: str, event: StoredEvent, suppress_reason: str | None) -> Script[bool]:
    added = yield Plan(
        "INSERT INTO provider_events (zone, source, event_id, key, received_at, data) "
        "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING 1",
        (
            zone,
            event.source,
            event.id,
            key,
            event.received_at,
            json.dumps(event.to_dict(), separators=(",", ":")),
        ),
    )
    if not added.rows:
        return False  # a repeated delivery of the same event changes nothing
    if suppress_reason is not None and event.recipient is not None:
        yield from suppress_add(zone, event.recipient, suppress_reason, event.received_at)
    return True


def remember_nonce(name: str, digest: str, until: float, now: float) -> Script[bool]:
    # An expired nonce is free again; a live one answers by its digest.
    taken = yield Plan(
        "INSERT INTO nonces (name, digest, until) VALUES (?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET digest = excluded.digest, until = excluded.until "
        "WHERE nonces.until < ? RETURNING digest",
        (name, digest, until, now),
    )
    if taken.rows:
        return True
    current = yield Plan("SELECT digest FROM nonces WHERE name = ?", (name,))
    return bool(current.rows) and current.rows[0][0] == digest


def events(rows: Iterable[tuple[Any, ...]]) -> list[StoredEvent]:
    return [StoredEvent.from_dict(json.loads(data)) for (data,) in rows]


def _among(column: str, forms: Sequence[str]) -> str:
    return f"{column} = ?" if len(forms) == 1 else f"{column} IN ({', '.join('?' * len(forms))})"


def find_records(column: str, forms: Sequence[str]) -> Plan:
    """Records holding an id in any of `forms`; `column` reads it from a row of events (its
    alias written `{t}`: each store keeps ids its own way)."""
    return Plan(f"SELECT data FROM events WHERE {_among(column.format(t=''), forms)} LIMIT 100", tuple(forms))


def records_for_event(column: str, forms: Sequence[str]) -> Plan:
    # The other-zone test is part of the query, before the LIMIT (DESIGN.md §18): however
    # many records of one zone hold the id, one record of another zone voids them all.
    return Plan(
        f"SELECT e.data FROM events e WHERE {_among(column.format(t='e.'), forms)} AND NOT EXISTS "
        f"(SELECT 1 FROM events o WHERE {_among(column.format(t='o.'), forms)} AND o.zone <> e.zone) "
        "ORDER BY e.updated_at DESC LIMIT 100",
        (*forms, *forms),
    )


def list_records(zone: str, state: str | None, since: float | None, before: float | None, limit: int) -> Plan:
    where: list[str] = ["zone = ?"]
    params: list[str | float] = [zone]
    index = "events_zone_updated"
    if state is not None:
        where.append("state = ?")
        params.append(state)
        index = "events_zone_state"
    if since is not None:
        where.append("updated_at >= ?")
        params.append(since)
    if before is not None:
        where.append("updated_at < ?")
        params.append(before)
    return Plan(
        f"SELECT data FROM events{{indexed {index}}} WHERE {' AND '.join(where)} "
        "ORDER BY updated_at DESC LIMIT ?",
        (*params, limit),
    )


def records(rows: Iterable[tuple[Any, ...]]) -> list[Record]:
    return [Record.from_dict(json.loads(data)) for (data,) in rows]


def audit_add(zone: str, entry: ZoneAudit) -> Plan:
    return Plan(
        "INSERT INTO zone_audit (zone, at, actor, action, key, note) VALUES (?, ?, ?, ?, ?, ?)",
        (zone, entry.at, entry.actor, entry.action, entry.key, entry.note),
    )


def queue_entries(zone: str | None) -> Plan:
    # CAST: PostgreSQL cannot tell the type of a parameter that is only compared with NULL.
    return Plan(
        "SELECT q.zone, q.key, q.lane, e.state, q.due_at, q.claimed_until, q.enqueued_at, "
        "length(q.content) FROM queue q LEFT JOIN events e ON e.zone = q.zone AND e.key = q.key "
        "WHERE (CAST(? AS text) IS NULL OR q.zone = ?) ORDER BY q.priority, q.due_at, q.zone, q.key",
        (zone, zone),
    )


def entries(rows: Iterable[tuple[Any, ...]], now: float) -> list[QueueEntry]:
    return [
        QueueEntry(
            str(z),
            str(k),
            str(lane),
            str(state) if state else "?",
            None if due >= HELD else float(due),
            claimed is not None and claimed > now,
            float(enq),
            int(size),
        )
        for z, k, lane, state, due, claimed, enq, size in rows
    ]


QUEUE_LANES = Plan("SELECT DISTINCT lane FROM queue")


def lanes(rows: Iterable[tuple[Any, ...]]) -> set[str]:
    return {str(lane) for (lane,) in rows}


QUEUE_DEPTHS = Plan("SELECT zone, lane, count(*) FROM queue GROUP BY zone, lane")


def queue_depths(rows: Iterable[tuple[Any, ...]]) -> dict[tuple[str, str], int]:
    return {(str(z), str(lane)): int(n) for z, lane, n in rows}
