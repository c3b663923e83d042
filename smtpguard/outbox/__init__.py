"""The outbox (DESIGN.md §20): rows an application commits in its own transaction, each
submitted through the SMTP pipeline as its source's zone user, with the receipt written back.

schema.py holds the table's DDL, rows.py every statement on it (claims and receipts),
connection.py how a source's database is reached, submit.py the seam to the pipeline,
reader.py the loop that ties them together, status.py what the console shows.
"""
