-- smtpguard's PostgreSQL schema, version 1. Applied once, at open, in one transaction
-- (smtpguard/store/postgres/__init__.py, _migrate_now). Add a new numbered file for a change;
-- never edit one that has shipped.
CREATE TABLE events (
    zone text NOT NULL, key text NOT NULL, version bigint NOT NULL, state text NOT NULL,
    updated_at double precision NOT NULL, data text NOT NULL,
    mid text, uid text, PRIMARY KEY (zone, key));
CREATE INDEX events_updated ON events (updated_at);
CREATE INDEX events_mid ON events (mid) WHERE mid IS NOT NULL;
CREATE INDEX events_uid ON events (uid) WHERE uid IS NOT NULL;
CREATE TABLE sends (
    zone text NOT NULL, token text NOT NULL, at double precision NOT NULL, month text NOT NULL,
    slot integer NOT NULL, PRIMARY KEY (zone, token));
CREATE INDEX sends_zone_at ON sends (zone, at);
-- A zone's cap counts are spread over slots (see _consume): one lock row per slot with the
-- number of its window rows (sends) kept, and the month's count kept per slot.
CREATE TABLE cap_slots (
    zone text NOT NULL, slot integer NOT NULL, n bigint NOT NULL DEFAULT 0, PRIMARY KEY (zone, slot));
CREATE TABLE monthly (
    zone text NOT NULL, month text NOT NULL, slot integer NOT NULL, used bigint NOT NULL,
    PRIMARY KEY (zone, month, slot));
CREATE TABLE paused (zone text PRIMARY KEY);
CREATE TABLE suppression (
    zone text NOT NULL, address text NOT NULL, reason text NOT NULL, at double precision NOT NULL,
    PRIMARY KEY (zone, address));
CREATE TABLE supp_versions (zone text PRIMARY KEY, v bigint NOT NULL);
CREATE TABLE auth_failures (ip text NOT NULL, at double precision NOT NULL);
CREATE INDEX auth_failures_ip_at ON auth_failures (ip, at);
CREATE TABLE queue (
    zone text NOT NULL, key text NOT NULL, lane text NOT NULL, priority integer NOT NULL,
    due_at double precision NOT NULL, claimed_until double precision,
    enqueued_at double precision NOT NULL, sender text NOT NULL, recipients text NOT NULL,
    content bytea NOT NULL, smtputf8 boolean NOT NULL DEFAULT false, PRIMARY KEY (zone, key));
CREATE INDEX queue_lane_due ON queue (lane, due_at);
CREATE TABLE circuits (
    instance text NOT NULL, provider text NOT NULL, circuit text NOT NULL,
    at double precision NOT NULL, PRIMARY KEY (instance, provider));
CREATE TABLE provider_events (
    zone text NOT NULL, source text NOT NULL, event_id text NOT NULL, key text NOT NULL,
    received_at double precision NOT NULL, seq bigserial, data text NOT NULL,
    PRIMARY KEY (zone, source, event_id));
CREATE INDEX provider_events_record ON provider_events (zone, key);
CREATE INDEX provider_events_received ON provider_events (received_at);
CREATE TABLE counters (
    zone text NOT NULL, name text NOT NULL, value bigint NOT NULL, PRIMARY KEY (zone, name));
-- One unit under a zone's caps, or an error naming the cap that refuses (the statement, and
-- its transaction, then leave nothing behind). See _consume in postgres.py for the slots.
CREATE FUNCTION smtpguard_count_unit(
    p_zone text, p_token text, p_now double precision, p_month text, p_slot integer,
    p_hour_start double precision, p_hourly bigint, p_monthly bigint, p_slots integer)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    m bigint; kept bigint; h bigint; oldest double precision;
BEGIN
    INSERT INTO sends (zone, token, at, month, slot) VALUES (p_zone, p_token, p_now, p_month, p_slot)
        ON CONFLICT (zone, token) DO NOTHING;
    IF NOT FOUND THEN
        RETURN;  -- counted by an earlier run of this call (DESIGN.md §11.4)
    END IF;
    BEGIN
        INSERT INTO cap_slots (zone, slot, n) VALUES (p_zone, p_slot, 1)
            ON CONFLICT (zone, slot) DO UPDATE SET n = cap_slots.n + 1;
        INSERT INTO monthly (zone, month, slot, used) VALUES (p_zone, p_month, p_slot, 1)
            ON CONFLICT (zone, month, slot) DO UPDATE SET used = monthly.used + 1;
        SELECT coalesce(sum(used), 0) INTO m FROM monthly WHERE zone = p_zone AND month = p_month;
        SELECT coalesce(sum(n), 0) INTO kept FROM cap_slots WHERE zone = p_zone;
        IF m + p_slots - 1 > p_monthly OR kept + p_slots - 1 > p_hourly THEN
            RAISE EXCEPTION 'near a cap' USING ERRCODE = 'SGN01';
        END IF;
    EXCEPTION WHEN SQLSTATE 'SGN01' THEN
        -- Near a cap: the slot given back (this block rolled back), every slot of the zone
        -- taken in order, the rows that left the hour dropped, the window counted exactly.
        INSERT INTO cap_slots (zone, slot) SELECT p_zone, generate_series(0, p_slots - 1)
            ON CONFLICT DO NOTHING;
        PERFORM 1 FROM cap_slots WHERE zone = p_zone ORDER BY slot FOR UPDATE;
        WITH gone AS (DELETE FROM sends WHERE zone = p_zone AND at < p_hour_start RETURNING slot),
             per AS (SELECT slot, count(*) AS c FROM gone GROUP BY slot)
        UPDATE cap_slots s SET n = greatest(s.n - per.c, 0) FROM per
            WHERE s.zone = p_zone AND s.slot = per.slot;
        SELECT coalesce(sum(used), 0) INTO m FROM monthly WHERE zone = p_zone AND month = p_month;
        IF m + 1 > p_monthly THEN
            RAISE EXCEPTION 'monthly cap' USING ERRCODE = 'SGM01';
        END IF;
        SELECT count(*) INTO h FROM sends WHERE zone = p_zone AND at >= p_hour_start;
        IF h > p_hourly THEN
            SELECT min(at) INTO oldest FROM sends
                WHERE zone = p_zone AND at >= p_hour_start AND token <> p_token;
            RAISE EXCEPTION '%', coalesce(oldest, p_now)::text USING ERRCODE = 'SGH01';
        END IF;
        UPDATE cap_slots SET n = n + 1 WHERE zone = p_zone AND slot = p_slot;
        INSERT INTO monthly (zone, month, slot, used) VALUES (p_zone, p_month, p_slot, 1)
            ON CONFLICT (zone, month, slot) DO UPDATE SET used = monthly.used + 1;
    END;
END
$fn$;
-- A claim in one statement: each lane's quota of the oldest due, unclaimed entries, then
-- the rest of the total from the lanes in order; rows another claim holds are skipped
-- (SKIP LOCKED), never waited on. An entry whose record was purged is dropped. Returns the
-- entries claimed, in the order picked.
CREATE FUNCTION smtpguard_claim(
    p_now double precision, p_lanes text[], p_counts integer[], p_until double precision)
RETURNS TABLE (o_n bigint, o_zone text, o_key text, o_sender text, o_recipients text,
    o_content bytea, o_priority integer, o_smtputf8 boolean, o_data text)
LANGUAGE plpgsql AS $fn$
DECLARE
    zs text[] := '{}'; ks text[] := '{}'; total integer; room integer; i integer; r record;
BEGIN
    SELECT coalesce(sum(greatest(c, 0)), 0) INTO total FROM unnest(p_counts) AS c;
    FOR pass IN 1 .. 2 LOOP
        FOR i IN 1 .. coalesce(array_length(p_lanes, 1), 0) LOOP
            room := CASE WHEN pass = 1 THEN p_counts[i] ELSE total - coalesce(array_length(zs, 1), 0) END;
            CONTINUE WHEN room <= 0;
            FOR r IN
                SELECT q.zone, q.key FROM queue q
                WHERE q.lane = p_lanes[i] AND q.due_at <= p_now
                  AND (q.claimed_until IS NULL OR q.claimed_until < p_now)
                  AND NOT EXISTS (SELECT 1 FROM unnest(zs, ks) AS p(z, k) WHERE p.z = q.zone AND p.k = q.key)
                ORDER BY q.due_at, q.zone, q.key LIMIT room FOR UPDATE SKIP LOCKED
            LOOP
                zs := zs || r.zone;
                ks := ks || r.key;
            END LOOP;
        END LOOP;
    END LOOP;
    DELETE FROM queue q USING unnest(zs, ks) AS p(z, k)
        WHERE q.zone = p.z AND q.key = p.k
          AND NOT EXISTS (SELECT 1 FROM events e WHERE e.zone = q.zone AND e.key = q.key);
    RETURN QUERY
        UPDATE queue q SET claimed_until = p_until
        FROM unnest(zs, ks) WITH ORDINALITY AS p(z, k, n), events e
        WHERE q.zone = p.z AND q.key = p.k AND e.zone = q.zone AND e.key = q.key
        RETURNING p.n, q.zone, q.key, q.sender, q.recipients, q.content, q.priority, q.smtputf8, e.data;
END
$fn$;
-- The reservation in one statement, so one round trip: the compare-and-swap on the
-- version, then the pause switch, then the cap unit. Returns 'written' or the current
-- version and data (the caller tells its own earlier write from a rival); a refusal is an
-- error (SGP01 paused, SGM01/SGH01 a cap), which rolls the write back.
CREATE FUNCTION smtpguard_reserve(
    p_zone text, p_key text, p_expected bigint, p_version bigint, p_state text,
    p_updated double precision, p_data text, p_mid text, p_uid text, p_paused boolean,
    p_has_cap boolean, p_cap_zone text, p_token text, p_now double precision, p_month text,
    p_slot integer, p_hour_start double precision, p_hourly bigint, p_monthly bigint,
    p_slots integer)
RETURNS TABLE (written boolean, version bigint, data text) LANGUAGE plpgsql AS $fn$
BEGIN
    IF p_expected IS NULL THEN
        INSERT INTO events (zone, key, version, state, updated_at, data, mid, uid)
            VALUES (p_zone, p_key, p_version, p_state, p_updated, p_data, p_mid, p_uid)
            ON CONFLICT (zone, key) DO NOTHING;
    ELSE
        UPDATE events e SET version = p_version, state = p_state, updated_at = p_updated,
            data = p_data, mid = p_mid, uid = p_uid
            WHERE e.zone = p_zone AND e.key = p_key AND e.version = p_expected;
    END IF;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, e.version, e.data FROM events e
            WHERE e.zone = p_zone AND e.key = p_key;
        RETURN;
    END IF;
    IF p_paused OR EXISTS (SELECT 1 FROM paused WHERE zone = p_zone) THEN
        RAISE EXCEPTION 'paused' USING ERRCODE = 'SGP01';
    END IF;
    IF p_has_cap THEN
        PERFORM smtpguard_count_unit(p_cap_zone, p_token, p_now, p_month, p_slot, p_hour_start,
            p_hourly, p_monthly, p_slots);
    END IF;
    RETURN QUERY SELECT true, NULL::bigint, NULL::text;
END
$fn$;
