"""bench/verdicts.py, small: 100 events through a real guard, 5% of the final-dot replies
lost, the provider's log showing every taken message after a random delay (injected clock).
Every lost outcome is settled by a verdict; the upstream holds exactly one copy of each
event; every retry is answered as a duplicate; the log API was asked a bounded number of
times."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.verdicts import run
from tests.support.verdicts import API_ENV, API_KEY


async def test_every_lost_reply_is_settled_by_a_verdict_and_none_is_sent_twice(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    report = await run(100, 0.05, None, tmp=tmp)
    assert report.lost == 5
    assert report.settled == {"delivered": 5} and report.unsettled == 0
    assert report.max_copies == 1 and report.missing == 0
    assert report.retry_replies == {"250 duplicate": 100}
    # each lost record: one look at `after`, then one every `every` until its entry shows
    # (at most 20 min of delay: 5 looks), each a single page; plus the first look's page
    assert 0 < report.api_requests <= 5 * 6
    # on the injected clock, so this is the schedule, not speed: visible within 20 min, then
    # found at the next look (every 5 min), the loop's clock moving in 30 s steps
    assert report.settle_p99 is not None and report.settle_p99 <= 20 * 60 + 5 * 60 + 30
