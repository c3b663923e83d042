"""SQL shared by the SQLite and PostgreSQL stores: statements written once (statements.py)
and the operations built of them (operations.py, cursors.py, purge.py). Each backend runs a
plan on its own connection, in its own transaction; nothing here does I/O."""
