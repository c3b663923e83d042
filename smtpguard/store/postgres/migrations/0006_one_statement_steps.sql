-- Version 6: the ledger steps that took several statements, each one statement (so one round
-- trip, and the refusal of any part still rolls back the whole): a reservation that counts a
-- user's unit too (it was BEGIN, the reservation, the user's unit, COMMIT: four round trips),
-- the units of consume_cap with a user's (likewise four), and a refund (up to nine). The
-- functions of versions 1 and 4 stay as they are: instances of the previous release call them.
CREATE FUNCTION smtpguard_reserve_user(
    p_zone text, p_key text, p_expected bigint, p_version bigint, p_state text,
    p_updated double precision, p_data text, p_mid text, p_uid text, p_paused boolean,
    p_has_cap boolean, p_cap_zone text, p_token text, p_now double precision, p_month text,
    p_slot integer, p_hour_start double precision, p_hourly bigint, p_monthly bigint,
    p_slots integer, p_user text, p_user_hourly bigint, p_user_monthly bigint)
RETURNS TABLE (written boolean, version bigint, data text) LANGUAGE plpgsql AS $fn$
DECLARE
    r record;
BEGIN
    SELECT * INTO r FROM smtpguard_reserve(p_zone, p_key, p_expected, p_version, p_state,
        p_updated, p_data, p_mid, p_uid, p_paused, p_has_cap, p_cap_zone, p_token, p_now,
        p_month, p_slot, p_hour_start, p_hourly, p_monthly, p_slots);
    IF NOT FOUND THEN
        RETURN;  -- no record under the key and none written
    END IF;
    IF r.written THEN
        PERFORM smtpguard_count_user_unit(p_cap_zone, p_user, p_token, p_now, p_month,
            p_hour_start, p_user_hourly, p_user_monthly);
    END IF;
    written := r.written;
    version := r.version;
    data := r.data;
    RETURN NEXT;
END
$fn$;
CREATE FUNCTION smtpguard_count_units(
    p_zone text, p_token text, p_now double precision, p_month text, p_slot integer,
    p_hour_start double precision, p_hourly bigint, p_monthly bigint, p_slots integer,
    p_user text, p_user_hourly bigint, p_user_monthly bigint)
RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM smtpguard_count_unit(p_zone, p_token, p_now, p_month, p_slot, p_hour_start,
        p_hourly, p_monthly, p_slots);
    PERFORM smtpguard_count_user_unit(p_zone, p_user, p_token, p_now, p_month, p_hour_start,
        p_user_hourly, p_user_monthly);
END
$fn$;
-- The month the unit was counted in is kept with it; p_month is the caller's guess. The
-- slot's row is locked before its sends row: the order the counts and the purge lock them in
-- (the other order deadlocks against them). The user's unit counted with the token, if any,
-- goes with it (DESIGN.md §16).
CREATE FUNCTION smtpguard_refund(p_zone text, p_token text, p_month text)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    s integer; m text; u text; um text;
BEGIN
    SELECT slot INTO s FROM sends WHERE zone = p_zone AND token = p_token;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM 1 FROM cap_slots WHERE zone = p_zone AND slot = s FOR UPDATE;
    DELETE FROM sends WHERE zone = p_zone AND token = p_token RETURNING month, slot INTO m, s;
    IF FOUND THEN
        UPDATE cap_slots SET n = greatest(n - 1, 0) WHERE zone = p_zone AND slot = s;
        UPDATE monthly SET used = greatest(used - 1, 0)
            WHERE zone = p_zone AND month = coalesce(nullif(m, ''), p_month) AND slot = s;
    END IF;
    DELETE FROM user_sends WHERE zone = p_zone AND token = p_token RETURNING username, month INTO u, um;
    IF FOUND THEN
        UPDATE user_monthly SET used = greatest(used - 1, 0)
            WHERE zone = p_zone AND username = u AND month = um;
    END IF;
END
$fn$;
