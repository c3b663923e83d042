-- Version 4: stream controls (DESIGN.md §16): paused message classes, and each SMTP user's
-- own cap units, kept by token as the zone's are (a refund names the token alone).
CREATE TABLE paused_classes (zone text NOT NULL, class text NOT NULL, PRIMARY KEY (zone, class));
CREATE TABLE user_sends (
    zone text NOT NULL, token text NOT NULL, username text NOT NULL, at double precision NOT NULL,
    month text NOT NULL, PRIMARY KEY (zone, token));
CREATE INDEX user_sends_user_at ON user_sends (zone, username, at);
CREATE TABLE user_monthly (
    zone text NOT NULL, username text NOT NULL, month text NOT NULL, used bigint NOT NULL,
    PRIMARY KEY (zone, username, month));
-- One unit under a user's own caps, or an error naming the cap that refuses (SGV01 the
-- month, SGU01 the hour with the oldest send in it). Called in the transaction that takes
-- the zone's unit, after it, so the error rolls both back. A user's units are counted one
-- at a time (a transaction lock on the user): exact, and a user's caps are small.
CREATE FUNCTION smtpguard_count_user_unit(
    p_zone text, p_user text, p_token text, p_now double precision, p_month text,
    p_hour_start double precision, p_hourly bigint, p_monthly bigint)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    m bigint; h bigint; oldest double precision;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('smtpguard-user:' || p_zone || ':' || p_user, 0));
    INSERT INTO user_sends (zone, token, username, at, month)
        VALUES (p_zone, p_token, p_user, p_now, p_month) ON CONFLICT (zone, token) DO NOTHING;
    IF NOT FOUND THEN
        RETURN;  -- counted by an earlier run of this call (DESIGN.md §11.4)
    END IF;
    INSERT INTO user_monthly (zone, username, month, used) VALUES (p_zone, p_user, p_month, 1)
        ON CONFLICT (zone, username, month) DO UPDATE SET used = user_monthly.used + 1
        RETURNING used INTO m;
    IF m > p_monthly THEN
        RAISE EXCEPTION 'user monthly cap' USING ERRCODE = 'SGV01';
    END IF;
    SELECT count(*) INTO h FROM user_sends
        WHERE zone = p_zone AND username = p_user AND at >= p_hour_start;
    IF h > p_hourly THEN
        SELECT min(at) INTO oldest FROM user_sends
            WHERE zone = p_zone AND username = p_user AND at >= p_hour_start AND token <> p_token;
        RAISE EXCEPTION '%', coalesce(oldest, p_now)::text USING ERRCODE = 'SGU01';
    END IF;
END
$fn$;
