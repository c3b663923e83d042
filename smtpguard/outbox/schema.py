"""The outbox table and its NOTIFY trigger (DESIGN.md §20): the DDL `outbox init` runs and
`outbox schema` prints for a migration tool.

The notification fires once per inserting statement and is delivered at COMMIT only, so a
rolled-back transaction wakes nobody (its rows never existed). The payload is empty: the
reader claims what is due, whoever woke it.
"""

from __future__ import annotations

DEFAULT_TABLE = "smtpguard_outbox"


def channel(table: str) -> str:
    """The LISTEN/NOTIFY channel of one outbox table."""
    return table


def listen(table: str) -> str:
    """The statement that subscribes to the table's channel."""
    return f"LISTEN {_quoted(channel(table))}"


def _quoted(name: str) -> str:
    # The config allows only [a-z0-9_] in a table name: no quote can occur inside.
    return f'"{name}"'


def ddl(table: str = DEFAULT_TABLE) -> str:
    """Idempotent (IF NOT EXISTS, OR REPLACE): running it twice changes nothing.

    Every name is quoted: a table the config accepts may be an SQL keyword (`order`)."""
    t, due, fn = (_quoted(n) for n in (table, f"{table}_due", f"{table}_notify"))
    return f"""\
CREATE TABLE IF NOT EXISTS {t} (
    id bigserial PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- written by the application, in its own transaction
    event_key text NOT NULL UNIQUE,
    message bytea NOT NULL,
    mail_from text NOT NULL,
    rcpt_to text[] NOT NULL,
    not_before timestamptz,
    -- written by smtpguard: the receipt
    state text NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'sent', 'duplicate', 'failed', 'held', 'expired')),
    reply text,
    sg_id text,
    upstream_id text,
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,
    done_at timestamptz
);

CREATE INDEX IF NOT EXISTS {due} ON {t} (next_attempt_at, id)
    WHERE state IN ('pending', 'held');

CREATE OR REPLACE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{channel(table)}', '');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS {fn} ON {t};
CREATE TRIGGER {fn} AFTER INSERT ON {t}
    FOR EACH STATEMENT EXECUTE FUNCTION {fn}();
"""
