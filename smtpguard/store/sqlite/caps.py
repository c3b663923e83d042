"""Cap units in SQLite (DESIGN.md §16): the zone's and a user's, counted or refused in the
writing transaction."""

from __future__ import annotations

import sqlite3

from smtpguard.policy.limits import HOUR, CapCheck, CapReached, Caps
from smtpguard.store.base import Paused


def _pause_or_cap(
    c: sqlite3.Connection, zone: str, paused: bool, cap: CapCheck | None
) -> Paused | CapReached | None:
    if paused or c.execute("SELECT 1 FROM paused WHERE zone = ?", (zone,)).fetchone():
        return Paused()
    return _consume(c, cap) if cap is not None else None


def _consume(c: sqlite3.Connection, cap: CapCheck) -> CapReached | None:
    """One unit of the zone's caps and, when the user has caps of its own, one of the
    user's (DESIGN.md §16): both or neither, in the one transaction."""
    refused = _consume_zone(c, cap)
    if refused is not None or cap.user is None or cap.user_caps is None:
        return refused
    refused = _consume_user(c, cap.zone, cap.user, cap.user_caps, cap)
    if refused is not None:
        c.execute("DELETE FROM sends WHERE zone = ? AND token = ?", (cap.zone, cap.token))
        c.execute("UPDATE send_counts SET n = MAX(n - 1, 0) WHERE zone = ?", (cap.zone,))
        _uncount_month(c, cap)
    return refused


def _consume_user(
    c: sqlite3.Connection, zone: str, user: str, caps: Caps, cap: CapCheck
) -> CapReached | None:
    """One unit of a user's own caps, exact: every unit is a row, counted in the window."""
    if not c.execute(
        "INSERT OR IGNORE INTO user_sends (zone, token, username, at, month) VALUES (?, ?, ?, ?, ?)",
        (zone, cap.token, user, cap.now, cap.month),
    ).rowcount:
        return None  # counted by an earlier run of this call (DESIGN.md §11.4)
    used = c.execute(
        "INSERT INTO user_monthly (zone, username, month, used) VALUES (?, ?, ?, 1) "
        "ON CONFLICT (zone, username, month) DO UPDATE SET used = used + 1 RETURNING used",
        (zone, user, cap.month),
    ).fetchone()[0]
    reached: CapReached | None = None
    if used > caps.monthly:
        reached = CapReached("month", caps.monthly, user=user)
    else:
        n, oldest = c.execute(
            "SELECT COUNT(*), MIN(CASE WHEN token != ? THEN at END) FROM user_sends "
            "WHERE zone = ? AND username = ? AND at >= ?",
            (cap.token, zone, user, cap.hour_start),
        ).fetchone()
        if n > caps.hourly:
            reached = CapReached("hour", caps.hourly, (oldest or cap.now) + HOUR, user=user)
    if reached is not None:
        c.execute("DELETE FROM user_sends WHERE zone = ? AND token = ?", (zone, cap.token))
        c.execute(
            "UPDATE user_monthly SET used = used - 1 WHERE zone = ? AND username = ? AND month = ?",
            (zone, user, cap.month),
        )
    return reached


def _refund_user(c: sqlite3.Connection, zone: str, token: str) -> None:
    row = c.execute(
        "DELETE FROM user_sends WHERE zone = ? AND token = ? RETURNING username, month", (zone, token)
    ).fetchone()
    if row is not None:
        c.execute(
            "UPDATE user_monthly SET used = MAX(used - 1, 0) WHERE zone = ? AND username = ? AND month = ?",
            (zone, row[0], row[1]),
        )


def _consume_zone(c: sqlite3.Connection, cap: CapCheck) -> CapReached | None:
    """Count one unit against both caps, or refuse and count nothing.

    Optimistic: each count is raised first, in one statement that returns the new total, and
    lowered again in the rare case it went over; check and count are one transaction.
    The sliding hour is exact: every send is a row and send_counts keeps the zone's row
    count. Rows that left the hour are dropped only when the count reaches the cap (and by
    the hourly purge), so a send within the cap costs no scan and no delete."""
    zone = cap.zone
    # The token first: a token counted already is a retried call (DESIGN.md §11.4), and
    # counts nothing again.
    if not c.execute(
        "INSERT OR IGNORE INTO sends (zone, token, at, month) VALUES (?, ?, ?, ?)",
        (zone, cap.token, cap.now, cap.month),
    ).rowcount:
        return None
    used = c.execute(
        "INSERT INTO monthly (zone, month, used) VALUES (?, ?, 1) "
        "ON CONFLICT (zone, month) DO UPDATE SET used = used + 1 RETURNING used",
        (zone, cap.month),
    ).fetchone()[0]
    if used > cap.caps.monthly:
        _uncount_month(c, cap)
        c.execute("DELETE FROM sends WHERE zone = ? AND token = ?", (zone, cap.token))
        return CapReached("month", cap.caps.monthly)
    row = c.execute("UPDATE send_counts SET n = n + 1 WHERE zone = ? RETURNING n", (zone,)).fetchone()
    if row is None:
        n = c.execute("SELECT COUNT(*) FROM sends WHERE zone = ?", (zone,)).fetchone()[0]
        c.execute("INSERT INTO send_counts (zone, n) VALUES (?, ?)", (zone, n))
    else:
        n = row[0]
    if n > cap.caps.hourly:
        _trim(c, zone, cap.hour_start)
        n = c.execute("SELECT n FROM send_counts WHERE zone = ?", (zone,)).fetchone()[0]
        if n > cap.caps.hourly:
            c.execute("DELETE FROM sends WHERE zone = ? AND token = ?", (zone, cap.token))
            c.execute("UPDATE send_counts SET n = n - 1 WHERE zone = ?", (zone,))
            _uncount_month(c, cap)
            oldest = c.execute("SELECT MIN(at) FROM sends WHERE zone = ?", (zone,)).fetchone()[0]
            return CapReached("hour", cap.caps.hourly, (oldest or cap.now) + HOUR)
    return None


def _uncount_month(c: sqlite3.Connection, cap: CapCheck) -> None:
    c.execute("UPDATE monthly SET used = used - 1 WHERE zone = ? AND month = ?", (cap.zone, cap.month))


def _trim(c: sqlite3.Connection, zone: str, before: float) -> None:
    """Drop the zone's sends older than `before`, keeping send_counts equal to its rows."""
    gone = c.execute("DELETE FROM sends WHERE zone = ? AND at < ?", (zone, before)).rowcount
    if gone:
        c.execute("UPDATE send_counts SET n = MAX(n - ?, 0) WHERE zone = ?", (gone, zone))
