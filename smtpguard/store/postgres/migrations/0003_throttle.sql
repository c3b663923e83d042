-- Version 3: provider throttling (DESIGN.md §16): each provider's next send slot (GCRA),
-- its throttle after a rate-limit reply, and the leased slots of its open connections.
CREATE TABLE rate_slots (provider text PRIMARY KEY, tat double precision NOT NULL);
CREATE TABLE throttles (provider text PRIMARY KEY, until double precision NOT NULL);
CREATE TABLE connection_slots (
    provider text NOT NULL, holder text NOT NULL, until double precision NOT NULL,
    PRIMARY KEY (provider, holder));
