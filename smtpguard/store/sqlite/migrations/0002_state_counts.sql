-- Version 2: records per zone and state, kept by triggers in the writing transaction:
-- counting the state index of a million records takes a quarter of a second, and the
-- console's zones page and the smtpguard_ledger_records gauge ask often. Created with
-- the counts of the records already there, in the migration's one transaction.
CREATE TABLE state_counts (
    zone TEXT NOT NULL, state TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (zone, state)) WITHOUT ROWID;
CREATE TRIGGER events_count_insert AFTER INSERT ON events BEGIN
    INSERT INTO state_counts (zone, state, n) VALUES (new.zone, new.state, 1)
    ON CONFLICT (zone, state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER events_count_update AFTER UPDATE OF state ON events WHEN old.state != new.state BEGIN
    UPDATE state_counts SET n = n - 1 WHERE zone = old.zone AND state = old.state;
    INSERT INTO state_counts (zone, state, n) VALUES (new.zone, new.state, 1)
    ON CONFLICT (zone, state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER events_count_delete AFTER DELETE ON events BEGIN
    UPDATE state_counts SET n = n - 1 WHERE zone = old.zone AND state = old.state;
END;
INSERT INTO state_counts (zone, state, n) SELECT zone, state, COUNT(*) FROM events GROUP BY zone, state;
