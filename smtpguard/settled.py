"""The delivered events this process has seen, so a duplicate costs no store round trip."""

from __future__ import annotations

from collections import OrderedDict

from smtpguard.policy import ledger
from smtpguard.policy.ledger import Record, State


class SettledCache:
    """Delivered events this process has seen, so a duplicate is answered with no store
    round trip. Sound because `delivered` is terminal: no transition leaves it, on any
    instance, until the record is purged after `retention` — which the cache honours too.
    One delivered record is not: one that owes the rest of its event (`owed`, recipients
    held at RCPT, DESIGN.md §21), which the rest's send, on any instance, takes out of
    `delivered` with another fingerprint and owed; it is never kept. Entries are slim
    copies (no attempt history) and the cache is bounded (LRU)."""

    def __init__(self, max_entries: int = 20_000) -> None:
        self._max = max_entries
        self._entries: OrderedDict[tuple[str, str], Record] = OrderedDict()

    def get(self, zone: str, key: str, now: float, retention: float) -> Record | None:
        rec = self._entries.get((zone, key))
        if rec is None:
            return None
        if now - rec.updated_at >= retention:
            del self._entries[(zone, key)]
            return None
        self._entries.move_to_end((zone, key))
        return rec

    def remember(self, rec: Record | None) -> None:
        if rec is None or rec.state is not State.DELIVERED or rec.owed is not None:
            return
        if self._entries.get((rec.zone, rec.key)) is rec:
            return  # a hit: get() has refreshed it already
        self._entries[(rec.zone, rec.key)] = ledger.evolve(rec, attempts=(), audit=())
        self._entries.move_to_end((rec.zone, rec.key))
        if len(self._entries) > self._max:
            self._entries.popitem(last=False)
