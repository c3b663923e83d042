"""Record rows of the PostgreSQL ledger and their compare-and-swap, and the arguments and
refusals of the cap-unit functions the migrations create."""

from __future__ import annotations

import json
import secrets
from typing import Any

import psycopg

from smtpguard.policy.events import bare_message_id
from smtpguard.policy.ledger import Record
from smtpguard.policy.limits import HOUR, CapCheck, CapReached
from smtpguard.store.base import Conflict, Paused, ReserveResult
from smtpguard.store.postgres.pool import Conn, _one

_SLOTS = 16
"""Cap count slots per zone: how many of a zone's reservations may commit at once while its
caps are far (see _consume)."""


def _dump(r: Record) -> str:
    return json.dumps(r.to_dict(), separators=(",", ":"))


def _load(data: str | None) -> Record | None:
    return Record.from_dict(json.loads(data)) if data else None


def _ids(r: Record) -> tuple[str | None, str | None]:
    return (_text(bare_message_id(r.message_id)) if r.message_id else None, _text(r.upstream_id) or None)


def _text(value: str | None) -> str | None:
    """As PostgreSQL can store it: a reply decoded with surrogateescape (an upstream that
    answered in Latin-1) has lone surrogates, which UTF-8 cannot carry."""
    if value is None or value.isascii():
        return value
    return value.encode("utf-8", "replace").decode("utf-8").replace("\x00", "")


async def _fetch(conn: Conn, zone: str, key: str) -> Record | None:
    row = await _one(conn, "SELECT data FROM events WHERE zone = %s AND key = %s", (zone, key))
    return _load(row[0]) if row else None


class _Own:
    pass


_OWN = _Own()
"""_swap's answer when the record already equals the one being written: a retried write
whose first run landed (DESIGN.md §11.4)."""


async def _swap(conn: Conn, r: Record, expected_version: int | None) -> Conflict | _Own | bool:
    """Write `r` over exactly `expected_version` (None: only if absent) in one statement;
    the current record is read only when that fails. A bool: written, and whether the zone
    is paused (read by the same statement, for reserve); _OWN: it was already there, byte
    for byte; else the Conflict with the current record."""
    data = _dump(r)
    mid, uid = _ids(r)
    if expected_version is None:
        written = await _one(
            conn,
            "INSERT INTO events (zone, key, version, state, updated_at, data, mid, uid) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (zone, key) DO NOTHING "
            "RETURNING EXISTS (SELECT 1 FROM paused p WHERE p.zone = events.zone)",
            (r.zone, r.key, r.version, r.state.value, r.updated_at, data, mid, uid),
        )
    else:
        written = await _one(
            conn,
            "UPDATE events SET version = %s, state = %s, updated_at = %s, data = %s, mid = %s, uid = %s "
            "WHERE zone = %s AND key = %s AND version = %s "
            "RETURNING EXISTS (SELECT 1 FROM paused p WHERE p.zone = events.zone)",
            (r.version, r.state.value, r.updated_at, data, mid, uid, r.zone, r.key, expected_version),
        )
    if written is not None:
        return bool(written[0])
    row = await _one(conn, "SELECT version, data FROM events WHERE zone = %s AND key = %s", (r.zone, r.key))
    if row is None:
        return Conflict(None)
    if int(row[0]) == r.version and row[1] == data:
        return _OWN
    return Conflict(_load(row[1]))


def _cap_args(cap: CapCheck | None, zone: str) -> tuple[Any, ...]:
    """smtpguard_count_unit's arguments (see the migration). A zone's count is spread over
    _SLOTS slots: one cap counter row, locked until COMMIT (and COMMIT waits for the WAL
    flush, and for a synchronous standby), would let one reservation of the zone commit at
    a time. A unit locks one slot and reads the zone's totals: counts of other slots not yet
    committed are invisible, but each holds its slot's lock, so at most _SLOTS - 1 are
    missing; the hour is bounded from above by the window rows each slot keeps (nothing is
    scanned). Within that margin of both caps the unit is counted at once; nearer, it takes
    every slot of the zone in order and counts exactly. No cap is ever exceeded."""
    if cap is None:
        return (zone, "", 0.0, "", 0, 0.0, 0, 0, _SLOTS)
    return (
        cap.zone, cap.token, cap.now, cap.month, secrets.randbelow(_SLOTS), cap.hour_start,
        cap.caps.hourly, cap.caps.monthly, _SLOTS,
    )  # fmt: skip


def _user_args(cap: CapCheck | None) -> tuple[Any, ...]:
    """The user's arguments of smtpguard_reserve_user and smtpguard_count_units (migration
    6, after the zone's); empty when the unit has no user cap."""
    if cap is None or cap.user is None or cap.user_caps is None:
        return ()
    return (cap.user, cap.user_caps.hourly, cap.user_caps.monthly)


def _refusal(e: psycopg.Error, cap: CapCheck | None) -> ReserveResult | None:
    """What an error raised by the reservation's functions answers, if it is a refusal."""
    if e.sqlstate == "SGP01":
        return Paused()
    if cap is None:
        return None
    if cap.user is not None and cap.user_caps is not None:
        if e.sqlstate == "SGV01":
            return CapReached("month", cap.user_caps.monthly, user=cap.user)
        if e.sqlstate == "SGU01":
            free = float(e.diag.message_primary or cap.now) + HOUR
            return CapReached("hour", cap.user_caps.hourly, free, user=cap.user)
    if e.sqlstate == "SGM01":
        return CapReached("month", cap.caps.monthly)
    if e.sqlstate == "SGH01":
        return CapReached("hour", cap.caps.hourly, float(e.diag.message_primary or cap.now) + HOUR)
    return None
