-- Version 2: the operator's desk (DESIGN.md §14), fleet-wide nonces (§13) and provider
-- probes (§12).
-- The id in smtpguard's replies, for `history --id`: read from the record's text, not as
-- jsonb (jsonb refuses what JSON text may hold: \u0000, a lone surrogate).
CREATE INDEX events_sid ON events ((substring(data from '"sg_id":"([^"]*)"')));
-- A zone's records by state, newest first, and all of them newest first.
CREATE INDEX events_zone_state ON events (zone, state, updated_at);
CREATE INDEX events_zone_updated ON events (zone, updated_at);
CREATE TABLE zone_audit (
    zone text NOT NULL, at double precision NOT NULL, actor text NOT NULL, action text NOT NULL,
    key text NOT NULL, note text NOT NULL, seq bigserial);
CREATE INDEX zone_audit_zone_at ON zone_audit (zone, at);
CREATE TABLE nonces (name text PRIMARY KEY, digest text NOT NULL, until double precision NOT NULL);
CREATE TABLE probes (
    instance text NOT NULL, provider text NOT NULL, ready boolean NOT NULL, detail text NOT NULL,
    at double precision NOT NULL, PRIMARY KEY (instance, provider));
