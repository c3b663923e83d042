"""The purge (DESIGN.md §4, §4a), written once for both SQL stores: which ledger records it
deletes, the queue entries that go with them, and what else ages out.

How the records are deleted is each store's own: SQLite in one statement of its writer's
transaction, PostgreSQL in batches of its own transactions (a busy ledger's first expiry
outlasts any one statement's deadline). So is the trim of each zone's cap window, which
keeps each store's own count of it in step (SQLite's send_counts, PostgreSQL's cap_slots).
"""

from __future__ import annotations

from smtpguard.policy.ledger import State
from smtpguard.policy.limits import WINDOW_KEEP
from smtpguard.store.sql.statements import Plan


def purgeable(cutoff: float, now: float) -> Plan:
    """The condition, over a row of `events` (named so, not aliased), that the purge deletes
    the record: unchanged since `cutoff` and settled. A deferred record whose message waits
    in its lane for a try (a backoff, a throttle or a downtime longer than the retention) is
    a live entry, as a queued one is: kept until its class's max_age (`expires_at`; absent:
    never), when a worker expires it."""
    expires = "{number data.expires_at}"
    return Plan(
        "updated_at < ? AND state NOT IN (?, ?) AND NOT (state = ? "
        f"AND ({expires} IS NULL OR {expires} > ?) "
        "AND EXISTS (SELECT 1 FROM queue q WHERE q.zone = events.zone AND q.key = events.key))",
        (cutoff, State.IN_FLIGHT.value, State.QUEUED.value, State.DEFERRED.value, now),
    )


ORPHANED_ENTRIES = Plan(
    "DELETE FROM queue WHERE NOT EXISTS "
    "(SELECT 1 FROM events e WHERE e.zone = queue.zone AND e.key = queue.key)"
)
"""Store-and-forward entries kept for an operator (unknown, failed) go with their record."""


def aged_out(now: float, retention: float) -> tuple[Plan, ...]:
    """Besides the records and the zones' cap windows: AUTH failures and users' cap units
    past any window, provider events and the zone audit past the retention, expired nonces."""
    return (
        Plan("DELETE FROM auth_failures WHERE at < ?", (now - WINDOW_KEEP,)),
        Plan("DELETE FROM user_sends WHERE at < ?", (now - WINDOW_KEEP,)),
        Plan("DELETE FROM provider_events WHERE received_at < ?", (now - retention,)),
        Plan("DELETE FROM nonces WHERE until < ?", (now,)),
        Plan("DELETE FROM zone_audit WHERE at < ?", (now - retention,)),
    )
