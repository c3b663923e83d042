-- Version 1: every table of the releases before numbered migrations. Written to run
-- again over a file of any of those releases (IF NOT EXISTS): it adds what that file lacks.
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
