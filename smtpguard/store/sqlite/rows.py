"""Reading and writing ledger rows: the compare-and-swap every write of a record goes through."""

from __future__ import annotations

import json
import sqlite3

from smtpguard.policy.ledger import Record
from smtpguard.policy.senders import suppression_key
from smtpguard.store.base import Conflict
from smtpguard.store.sql import operations


def _load(c: sqlite3.Connection, zone: str, key: str) -> Record | None:
    row = c.execute("SELECT data FROM events WHERE zone = ? AND key = ?", (zone, key)).fetchone()
    return Record.from_dict(json.loads(row[0])) if row else None


def _save(c: sqlite3.Connection, r: Record) -> None:
    c.execute(
        "INSERT INTO events (zone, key, version, state, updated_at, data) VALUES (?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (zone, key) DO UPDATE SET version = excluded.version, state = excluded.state, "
        "updated_at = excluded.updated_at, data = excluded.data",
        (
            r.zone,
            r.key,
            r.version,
            r.state.value,
            r.updated_at,
            json.dumps(r.to_dict(), separators=(",", ":")),
        ),
    )


def _fold_suppression_keys(c: sqlite3.Connection) -> None:
    """Entries written before suppression compared case-folded addresses are re-keyed
    (policy/senders.suppression_key), so `Bob@x` listed then stops `bob@x` now. Only rows
    that may differ are read: any upper-case ASCII letter, or any non-ASCII character."""
    rows = c.execute(
        "SELECT zone, address, reason, at FROM suppression "
        "WHERE address != lower(address) OR address GLOB '*[^ -~]*'"
    ).fetchall()
    for zone, address, reason, at in rows:
        folded = suppression_key(address)
        if folded == address:
            continue
        c.execute(
            "INSERT OR IGNORE INTO suppression (zone, address, reason, at) VALUES (?, ?, ?, ?)",
            (zone, folded, reason, at),
        )
        c.execute("DELETE FROM suppression WHERE zone = ? AND address = ?", (zone, address))
        c.execute(*operations.bump_supp_version(zone).sqlite())


_OWN = "own"
"""_swap's answer when the record already equals the one being written: a retried write
whose first run landed (DESIGN.md §11.4)."""


def _swap(c: sqlite3.Connection, r: Record, expected_version: int | None) -> Conflict | str | None:
    """Write `r` over exactly `expected_version` (None: only if absent) in one statement;
    the current record is read only when the swap fails. None: written; _OWN: it was
    already there, byte for byte; else the Conflict with the current record."""
    data = json.dumps(r.to_dict(), separators=(",", ":"))
    if expected_version is None:
        written = c.execute(
            "INSERT OR IGNORE INTO events (zone, key, version, state, updated_at, data) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (r.zone, r.key, r.version, r.state.value, r.updated_at, data),
        ).rowcount
    else:
        written = c.execute(
            "UPDATE events SET version = ?, state = ?, updated_at = ?, data = ? "
            "WHERE zone = ? AND key = ? AND version = ?",
            (r.version, r.state.value, r.updated_at, data, r.zone, r.key, expected_version),
        ).rowcount
    if written == 1:
        return None
    row = c.execute("SELECT version, data FROM events WHERE zone = ? AND key = ?", (r.zone, r.key)).fetchone()
    if row is None:
        return Conflict(None)
    if row[0] == r.version and row[1] == data:
        return _OWN
    return Conflict(Record.from_dict(json.loads(row[1])))


def _cas(c: sqlite3.Connection, r: Record, expected_version: int | None) -> Conflict | None:
    swapped = _swap(c, r, expected_version)
    return swapped if isinstance(swapped, Conflict) else None
