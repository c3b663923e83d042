"""Opening a SQLite file: its connections, and what a reader does with a file of an older
schema."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from urllib.parse import quote

_MIN_SQLITE = (3, 35, 0)
"""RETURNING (the optimistic cap counts) needs SQLite 3.35."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    zone TEXT NOT NULL, key TEXT NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL,
    updated_at REAL NOT NULL, data TEXT NOT NULL, PRIMARY KEY (zone, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_updated ON events (updated_at);
CREATE TABLE IF NOT EXISTS sends (
    zone TEXT NOT NULL, token TEXT NOT NULL, at REAL NOT NULL, month TEXT NOT NULL,
    PRIMARY KEY (zone, token)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS sends_zone_at ON sends (zone, at);
CREATE TABLE IF NOT EXISTS send_counts (zone TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS monthly (
    zone TEXT NOT NULL, month TEXT NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (zone, month)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS paused (zone TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS suppression (
    zone TEXT NOT NULL, address TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (zone, address)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS supp_versions (zone TEXT PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS auth_failures (ip TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS auth_failures_ip_at ON auth_failures (ip, at);
CREATE TABLE IF NOT EXISTS queue (
    zone TEXT NOT NULL, key TEXT NOT NULL, lane TEXT NOT NULL, priority INTEGER NOT NULL,
    due_at REAL NOT NULL, claimed_until REAL, enqueued_at REAL NOT NULL, sender TEXT NOT NULL,
    recipients TEXT NOT NULL, content BLOB NOT NULL, smtputf8 INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (zone, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS queue_lane_due ON queue (lane, due_at);
CREATE TABLE IF NOT EXISTS circuits (
    instance TEXT NOT NULL, provider TEXT NOT NULL, circuit TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (instance, provider)) WITHOUT ROWID;
-- Provider events (DESIGN.md §13): one row per event applied; the key makes an event
-- applied once, and the rows of a record are its `events` history.
CREATE TABLE IF NOT EXISTS provider_events (
    zone TEXT NOT NULL, source TEXT NOT NULL, event_id TEXT NOT NULL, key TEXT NOT NULL,
    received_at REAL NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (zone, source, event_id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS provider_events_of_record ON provider_events (zone, key, received_at);
CREATE INDEX IF NOT EXISTS provider_events_received ON provider_events (received_at);
-- A provider event names its message by Message-ID or by the id in the provider's 250.
CREATE INDEX IF NOT EXISTS events_message_id ON events (json_extract(data, '$.message_id'));
CREATE INDEX IF NOT EXISTS events_upstream_id ON events (json_extract(data, '$.upstream_id'));
CREATE INDEX IF NOT EXISTS events_sg_id ON events (json_extract(data, '$.sg_id'));
-- The operator's lists (DESIGN.md §14): a zone's records by state, newest first.
CREATE INDEX IF NOT EXISTS events_zone_state ON events (zone, state, updated_at);
CREATE INDEX IF NOT EXISTS events_zone_updated ON events (zone, updated_at);
-- Zone-level operator actions (pause, resume, suppress, queue drop, decisions).
CREATE TABLE IF NOT EXISTS zone_audit (
    zone TEXT NOT NULL, at REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
    key TEXT NOT NULL, note TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS zone_audit_zone_at ON zone_audit (zone, at);
CREATE TABLE IF NOT EXISTS probes (
    instance TEXT NOT NULL, provider TEXT NOT NULL, ready INTEGER NOT NULL, detail TEXT NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (instance, provider)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS nonces (
    name TEXT PRIMARY KEY, digest TEXT NOT NULL, until REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (
    zone TEXT NOT NULL, name TEXT NOT NULL, value INTEGER NOT NULL,
    PRIMARY KEY (zone, name)) WITHOUT ROWID;
-- Provider throttling (DESIGN.md §16): each provider's next send slot (GCRA), its
-- throttle after a rate-limit reply, and the leased slots of its open connections.
CREATE TABLE IF NOT EXISTS rate_slots (provider TEXT PRIMARY KEY, tat REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS throttles (provider TEXT PRIMARY KEY, until REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS connection_slots (
    provider TEXT NOT NULL, holder TEXT NOT NULL, until REAL NOT NULL,
    PRIMARY KEY (provider, holder)) WITHOUT ROWID;
-- Stream controls (DESIGN.md §16): one message class of a zone paused; each SMTP user's
-- own cap units, kept by token as the zone's are (a refund names the token alone).
CREATE TABLE IF NOT EXISTS paused_classes (
    zone TEXT NOT NULL, class TEXT NOT NULL, PRIMARY KEY (zone, class)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS user_sends (
    zone TEXT NOT NULL, token TEXT NOT NULL, username TEXT NOT NULL, at REAL NOT NULL,
    month TEXT NOT NULL, PRIMARY KEY (zone, token)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS user_sends_user_at ON user_sends (zone, username, at);
CREATE TABLE IF NOT EXISTS user_monthly (
    zone TEXT NOT NULL, username TEXT NOT NULL, month TEXT NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (zone, username, month)) WITHOUT ROWID;
"""


_STATE_COUNTS = (
    "CREATE TABLE state_counts (zone TEXT NOT NULL, state TEXT NOT NULL, n INTEGER NOT NULL, "
    "PRIMARY KEY (zone, state)) WITHOUT ROWID",
    "CREATE TRIGGER events_count_insert AFTER INSERT ON events BEGIN "
    "INSERT INTO state_counts (zone, state, n) VALUES (new.zone, new.state, 1) "
    "ON CONFLICT (zone, state) DO UPDATE SET n = n + 1; END",
    "CREATE TRIGGER events_count_update AFTER UPDATE OF state ON events WHEN old.state != new.state BEGIN "
    "UPDATE state_counts SET n = n - 1 WHERE zone = old.zone AND state = old.state; "
    "INSERT INTO state_counts (zone, state, n) VALUES (new.zone, new.state, 1) "
    "ON CONFLICT (zone, state) DO UPDATE SET n = n + 1; END",
    "CREATE TRIGGER events_count_delete AFTER DELETE ON events BEGIN "
    "UPDATE state_counts SET n = n - 1 WHERE zone = old.zone AND state = old.state; END",
    "INSERT INTO state_counts (zone, state, n) SELECT zone, state, COUNT(*) FROM events GROUP BY zone, state",
)


def _count_states(conn: sqlite3.Connection) -> None:
    """Records per zone and state, kept by triggers in the writing transaction: counting
    the state index of a million records takes a quarter of a second, and the console's
    zones page and the smtpguard_ledger_records gauge ask often. Created once, with the
    counts of the records already there, in one transaction (another process may be
    writing)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'state_counts'"
        ).fetchone()
        if exists is None:
            for statement in _STATE_COUNTS:
                conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def path_from_url(url: str) -> Path:
    """`sqlite:///var/x.db` is relative to the working directory, `sqlite:////x.db` absolute."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite URL: {url}")
    return Path(url[len("sqlite:///") :])


_CREATE = re.compile(r"CREATE (TABLE|INDEX) IF NOT EXISTS (\w+)(?: ON (\w+))?")


def _stand_in_for_missing_tables(conn: sqlite3.Connection) -> None:
    """A store written by an older version lacks the newer tables until `serve` opens it for
    writing (CREATE IF NOT EXISTS). A read-only opener (the CLI) cannot create them there, so
    it creates empty TEMP tables of the same names on its own connection: each read of one
    finds nothing, rather than failing with "no such table"."""
    present = {str(name) for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    temp: set[str] = set()
    schema = "\n".join(line for line in _SCHEMA.splitlines() if not line.startswith("--"))
    for statement in schema.split(";"):
        sql = statement.strip()
        m = _CREATE.match(sql)
        if m is None or m.group(2) in present:
            continue
        kind, name, table = m.groups()
        if kind == "TABLE":
            conn.execute(sql.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))
            temp.add(name)
        elif table in temp:
            conn.execute(sql.replace(f"EXISTS {name}", f"EXISTS temp.{name}", 1))


def _index_names(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' "
        "UNION SELECT name FROM sqlite_temp_master WHERE type = 'index'"
    )
    return {str(name) for (name,) in rows}


def _connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        # mode=ro: a reader never creates the file, whatever the working directory.
        uri = f"file:{quote(str(path.absolute()))}?mode=ro"
        conn = sqlite3.connect(uri, isolation_level=None, check_same_thread=False, timeout=30, uri=True)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    if readonly:
        _stand_in_for_missing_tables(conn)
        conn.execute("PRAGMA query_only = ON")
    else:
        conn.execute("PRAGMA journal_mode = WAL")
        # FULL: a commit is on disk before the writer reports it (the 250 depends on it).
        conn.execute("PRAGMA synchronous = FULL")
    return conn
