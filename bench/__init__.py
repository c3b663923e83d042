"""Benchmarks for smtpguard: `python -m bench.relay`, `python -m bench.idle`, `python -m bench.ledger`.

Everything here talks only to 127.0.0.1, starts its own servers on free ports and stops
them by PID. Results go to bench/results/ (gitignored). See bench/README.md.
"""
