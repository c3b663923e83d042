"""Readiness (DESIGN.md §12): DNS lookups through one resolver seam, provider probes, and
`smtpguard doctor`, which puts them before policy/readiness.py's verdicts."""
