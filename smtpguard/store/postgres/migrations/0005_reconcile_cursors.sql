-- Version 5: where reconciliation of each provider's log API has read up to (DESIGN.md §19).
CREATE TABLE reconcile_cursors (name text PRIMARY KEY, at double precision NOT NULL);
