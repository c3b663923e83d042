"""The Redis store's reads for the operator's desk (records by time and state, state counts,
the zone's audit log) and of the queue (its lanes, entries and depths)."""

from __future__ import annotations

import json
from typing import Any

from smtpguard.policy.ledger import Record, State
from smtpguard.store.base import HELD, QueueEntry, ZoneAudit
from smtpguard.store.redis.connection import _PURGE_BATCH, RedisConnection, _translated
from smtpguard.store.redis.keys import (
    _QUEUED_ZONES,
    _STATES_LISTED,
    _ZONES,
    _audit_key,
    _claimed_key,
    _index_key,
    _lane_key,
    _lanes_key,
    _queue_key,
    _record_key,
    _state_key,
    _zone_prefix,
)
from smtpguard.store.redis.ledger import _load

_AUDIT_KEPT = 10_000
"""Zone audit entries kept per zone (newest)."""


class Desk(RedisConnection):
    async def queue_lanes(self) -> set[str]:
        lanes: set[str] = set()
        for zone in await self._smembers(_QUEUED_ZONES):
            lanes |= await self._zone_lanes(zone)
        return lanes

    @_translated
    async def _zone_lanes(self, zone: str) -> set[str]:
        """The zone's lanes that hold entries. The set of lane names only grows (each enqueue
        adds its lane in the same script as the entry): removing an empty one here could
        race an enqueue into it and hide that entry from the orphan scan."""
        found: set[str] = set()
        for lane in await self._r.smembers(_lanes_key(zone)):
            if await self._r.zcard(_lane_key(zone, str(lane))):
                found.add(str(lane))
        return found

    async def queue_entries(self, zone: str | None) -> list[QueueEntry]:
        if zone is not None:
            zones = [zone]
        else:
            zones = sorted(set(await self._smembers(_QUEUED_ZONES)) | set(await self._smembers(_ZONES)))
        now = self._clock.now()  # the clock the claims were written on (DESIGN.md §11.5)
        out: list[tuple[int, float, QueueEntry]] = []
        for z in zones:
            for key, lane, priority, due, enqueued, size, state, until in await self._zone_entries(z):
                due_at = float(due)
                entry = QueueEntry(
                    z,
                    key,
                    lane,
                    state or "?",
                    None if due_at >= HELD else due_at,
                    bool(until) and float(until) > now,
                    float(enqueued),
                    int(size),
                )
                out.append((int(priority), due_at, entry))
        out.sort(key=lambda e: (e[0], e[1], e[2].zone, e[2].key))
        return [entry for _, _, entry in out]

    @_translated
    async def queue_depths(self) -> dict[tuple[str, str], int]:
        zones = sorted(set(await self._smembers(_QUEUED_ZONES)) | set(await self._smembers(_ZONES)))
        async with self._r.pipeline(transaction=False) as pipe:
            for z in zones:
                pipe.smembers(_lanes_key(z))
            lane_sets: list[set[Any]] = await pipe.execute()
        pairs = [(z, str(lane)) for z, lanes in zip(zones, lane_sets, strict=True) for lane in sorted(lanes)]
        async with self._r.pipeline(transaction=False) as pipe:
            for z, lane in pairs:
                pipe.zcard(_lane_key(z, lane))
            counts: list[int] = await pipe.execute()
        return {pair: int(n) for pair, n in zip(pairs, counts, strict=True) if n}

    @_translated
    async def _zone_entries(self, zone: str) -> list[list[Any]]:
        keys = [_queue_key(zone), _claimed_key(zone)]
        entries: list[list[Any]] = await self._eval(self._entries, keys, [_zone_prefix(zone)])
        return entries

    @_translated
    async def list_records(
        self, zone: str, state: str | None, since: float | None, before: float | None, limit: int
    ) -> list[Record]:
        high = f"({before!r}" if before is not None else "+inf"
        low = repr(since) if since is not None else "-inf"
        if state is None or await self._flag_get(_STATES_LISTED):
            index = _index_key(zone) if state is None else _state_key(zone, state)
            members = await self._r.zrevrangebyscore(index, high, low, start=0, num=limit)
            return [r for r in await self._records(zone, members) if state is None or r.state == state]
        # Records written before the per-state sets existed are in none yet (the background
        # upgrade fills them): walk the zone's index and filter, a page at a time.
        found: list[Record] = []
        offset = 0
        while len(found) < limit:
            members = await self._r.zrevrangebyscore(
                _index_key(zone), high, low, start=offset, num=_PURGE_BATCH
            )
            found += [r for r in await self._records(zone, members) if r.state == state]
            if len(members) < _PURGE_BATCH:
                break
            offset += len(members)
        return found[:limit]

    async def _records(self, zone: str, members: list[Any]) -> list[Record]:
        async with self._r.pipeline(transaction=False) as pipe:
            for m in members:
                pipe.hget(_record_key(zone, str(m)), "d")
            datas = await pipe.execute()
        return [r for r in (_load(d if isinstance(d, str) else None) for d in datas) if r is not None]

    @_translated
    async def state_counts(self, zone: str) -> dict[str, int]:
        async with self._r.pipeline(transaction=False) as pipe:
            for st in State:
                pipe.zcard(_state_key(zone, st.value))
            counts = await pipe.execute()
        return {st.value: int(n) for st, n in zip(State, counts, strict=True) if n}

    @_translated
    async def audit_add(self, zone: str, entry: ZoneAudit) -> None:
        item = json.dumps(
            {
                "at": entry.at,
                "actor": entry.actor,
                "action": entry.action,
                "key": entry.key,
                "note": entry.note,
            },
            separators=(",", ":"),
        )
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.lpush(_audit_key(zone), item)
            pipe.ltrim(_audit_key(zone), 0, _AUDIT_KEPT - 1)
            await pipe.execute()

    @_translated
    async def audit_log(self, zone: str, since: float, limit: int = 1000) -> list[ZoneAudit]:
        items = await self._r.lrange(_audit_key(zone), 0, limit - 1)
        entries = [ZoneAudit(**json.loads(item)) for item in items]
        return [e for e in entries if e.at >= since]
