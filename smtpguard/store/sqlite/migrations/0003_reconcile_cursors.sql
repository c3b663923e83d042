-- Version 3: where reconciliation of each provider's log API has read up to (DESIGN.md §19).
CREATE TABLE IF NOT EXISTS reconcile_cursors (name TEXT PRIMARY KEY, at REAL NOT NULL);
