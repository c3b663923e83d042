"""Provider events (DESIGN.md §13): what happened after the 250 comes back and feeds the
ledger's history and the suppression lists."""
