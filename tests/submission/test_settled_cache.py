"""The in-process cache of delivered events that answers duplicates without the store."""

from __future__ import annotations

from dataclasses import replace

from smtpguard.policy import ledger
from smtpguard.policy.ledger import LedgerSettings, State, Submission
from smtpguard.submission import SettledCache

NOW = 1_800_000_000.0


def record(key: str, state: State) -> ledger.Record:
    verdict = ledger.decide(None, Submission("acme", key, "fp", "id", "i", None), NOW, LedgerSettings())
    assert isinstance(verdict, ledger.Proceed)
    return replace(
        verdict.record, state=state, attempts=(ledger.Attempt("id", NOW, "i", "p", "data_sent", "delivered"),)
    )


def test_only_delivered_records_are_kept_slim() -> None:
    cache = SettledCache()
    cache.remember(record("a", State.DEFERRED))
    cache.remember(record("b", State.DELIVERED))
    cache.remember(None)
    assert cache.get("acme", "a", NOW, 86400) is None
    got = cache.get("acme", "b", NOW, 86400)
    assert got is not None and got.state is State.DELIVERED and got.attempts == ()


def test_entries_expire_with_retention_and_the_oldest_go_first() -> None:
    cache = SettledCache(max_entries=2)
    for k in ("x", "y", "z"):
        cache.remember(record(k, State.DELIVERED))
    assert cache.get("acme", "x", NOW, 86400) is None  # evicted
    assert cache.get("acme", "y", NOW, 86400) is not None
    assert cache.get("acme", "z", NOW + 86400, 86400) is None  # past retention: purged in the store too
