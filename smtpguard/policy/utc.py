"""A moment as smtpguard writes it: UTC, to the second, `Z` for the zone.

Two spellings of it exist, and each keeps its own so that no output changes: `iso_z`
(isoformat) for the CLI, the console and the operator's refusals, and `stamp` (replies.py's
strftime) for the SMTP replies and the provider APIs' queries. They write the same text for
every year from 1000 on; before it, isoformat pads the year to four digits and strftime
does not (a stored time that was never a real moment, shown as it is).
"""

from __future__ import annotations

from datetime import UTC, datetime

# For the rooms that write a time as the replies do but do not import replies (verdicts/).
from smtpguard.replies import stamp as stamp


def iso_z(epoch: float) -> str:
    """`2026-12-02T09:15:51Z`: ISO 8601, the fraction of a second dropped."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
