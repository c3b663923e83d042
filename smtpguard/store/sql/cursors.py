"""The reconciliation cursors (DESIGN.md §19), written once for both SQL stores: one row per
log API, moved by compare-and-swap so that only the instance that read the cursor as it
still is can advance it. Each is a single statement, so no lock is needed: the row's key or
its current value decides, and the row count says whether this caller won."""

from __future__ import annotations

from smtpguard.store.sql.statements import Plan, Script


def cursor(name: str) -> Script[float | None]:
    result = yield Plan("SELECT at FROM reconcile_cursors WHERE name = ?", (name,))
    return float(result.rows[0][0]) if result.rows else None


def advance(name: str, expected: float | None, new: float) -> Script[bool]:
    if expected is None:
        plan = Plan(
            "INSERT INTO reconcile_cursors (name, at) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
            (name, new),
        )
    else:
        plan = Plan("UPDATE reconcile_cursors SET at = ? WHERE name = ? AND at = ?", (new, name, expected))
    result = yield plan
    return result.rowcount == 1
