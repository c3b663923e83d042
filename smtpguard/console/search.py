"""The console's search box: one string, looked up as every id a record is known by — its
event key (alone or zone-qualified, `zone:key`), smtpguard's id (`sg:…` or bare), the
Message-ID (with or without <>) and the provider's upstream id — the lookups of `history
--id`, `--message-id` and `--upstream-id`. Only configured zones are shown: the console's
pages are per configured zone."""

from __future__ import annotations

from dataclasses import dataclass

from smtpguard.config import Config
from smtpguard.policy.ledger import Record
from smtpguard.store import Store
from smtpguard.store.base import IdField

QUERY_MAX = 1000
"""Longer than any key (200), Message-ID or provider id: a longer query is refused."""

_BY: tuple[tuple[IdField, str], ...] = (
    ("sg_id", "sg id"),
    ("message_id", "Message-ID"),
    ("upstream_id", "upstream id"),
)


@dataclass(frozen=True, slots=True)
class Found:
    record: Record
    by: str
    """Which id matched: key, sg id, Message-ID or upstream id."""


async def search(config: Config, store: Store, query: str) -> list[Found]:
    """The records `query` names, newest first, each once (under the first id it matched)."""
    q = query.strip()
    if not q:
        return []
    zones = config.zones
    found: dict[tuple[str, str], Found] = {}

    def add(rec: Record | None, by: str) -> None:
        if rec is not None and rec.zone in zones:
            found.setdefault((rec.zone, rec.key), Found(rec, by))

    for zone in sorted(zones):
        add(await store.get(zone, q), "key")
    zone, sep, key = q.partition(":")
    if sep and zone in zones and key:
        add(await store.get(zone, key), "key")
    for field, by in _BY:
        value = q.removeprefix("sg:") if field == "sg_id" else q
        for rec in await store.find_records(field, value):
            add(rec, by)
    return sorted(found.values(), key=lambda f: f.record.updated_at, reverse=True)
