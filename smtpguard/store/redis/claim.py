"""Claiming store-and-forward entries across zones (RedisStore.claim) and its plan."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from smtpguard.policy.ledger import Record
from smtpguard.store.base import Claimed, QueuedMessage
from smtpguard.store.redis.connection import RedisConnection, _translated
from smtpguard.store.redis.keys import (
    _QUEUED_ZONES,
    _ZONE_ANNOUNCE_EVERY,
    _ZONES,
    _claimed_key,
    _lane_key,
    _queue_key,
    _zone_prefix,
)

# Peek-and-claim rounds of one claim across zones before it settles for fewer entries.
_CLAIM_ROUNDS = 4


class Claims(RedisConnection):
    _queued_swept_at: float | None

    async def claim(self, now: float, quotas: list[tuple[str, int]], lease: float) -> list[Claimed]:
        """Claims zone by zone: each zone's script is atomic in its slot, which is all a claim
        needs (an entry belongs to one zone, and a claimed entry is hidden from every other
        script). With several zones queued, a pipelined peek first finds the oldest due
        entries across zones, so zones are served in due order as by the SQLite backend; a
        zone that gives fewer than planned (a rival claimed them since the peek) sends the
        claim round again for what is left."""
        lanes: list[str] = []
        counts: list[int] = []
        for lane, n in quotas:
            if lane in lanes:
                counts[lanes.index(lane)] += max(n, 0)
            else:
                lanes.append(lane)
                counts.append(max(n, 0))
        total = sum(counts)
        if total <= 0:
            return []
        listed = set(await self._smembers(_QUEUED_ZONES))
        zones = set(listed)
        swept = self._queued_swept_at
        if swept is None or time.monotonic() - swept >= _ZONE_ANNOUNCE_EVERY:
            zones |= set(await self._smembers(_ZONES))
            self._queued_swept_at = time.monotonic()
        if not zones:
            return []
        got: list[tuple[int, float, str, str, Claimed]] = []
        sizes: dict[str, int] = {}
        want, room = counts, total
        for _ in range(_CLAIM_ROUNDS):
            plan: dict[str, tuple[list[int], int]]
            if len(zones) == 1:
                # The zone's script alone makes the whole choice, quotas then fill.
                plan = {zone: (want, room) for zone in zones}
            else:
                peeked, due = await self._peek_zones(sorted(zones), lanes, now, room)
                sizes.update(peeked)
                plan = {zone: (n, sum(n)) for zone, n in _plan(due, want, room).items()}
            results = await asyncio.gather(
                *(self._claim_zone(zone, lanes, n, t, now, now + lease) for zone, (n, t) in plan.items()),
                return_exceptions=True,
            )
            short = False
            errors: list[BaseException] = []
            for (zone, (_, planned)), result in zip(plan.items(), results, strict=True):
                if isinstance(result, BaseException):
                    errors.append(result)
                    continue
                sizes[zone] = result[0]
                got += result[1]
                short = short or len(result[1]) < planned
            if errors:
                if not got:
                    raise errors[0]
                # What was claimed is returned; the error comes back on the next claim.
                break
            room = total - len(got)
            if not short or room <= 0 or len(zones) == 1:
                break
            per_lane = [sum(1 for g in got if g[0] == li) for li in range(len(lanes))]
            want = [max(n - k, 0) for n, k in zip(counts, per_lane, strict=True)]
        await self._tidy_queued_zones(listed, sizes)
        # The order the SQLite backend returns: each lane's quota, oldest first, then the fill.
        by_lane: list[list[Claimed]] = [[] for _ in lanes]
        for li, _, _, _, claimed in sorted(got, key=lambda g: g[:4]):
            by_lane[li].append(claimed)
        ordered = [c for li, n in enumerate(counts) for c in by_lane[li][:n]]
        return ordered + [c for li, n in enumerate(counts) for c in by_lane[li][n:]]

    @_translated
    async def _peek_zones(
        self, zones: list[str], lanes: list[str], now: float, limit: int
    ) -> tuple[dict[str, int], list[list[tuple[float, str, str]]]]:
        """Each zone's queue size, and per lane the due, unclaimed (due, zone, key) entries."""
        script = self._script(self._peek)
        async with self._r.pipeline(transaction=False) as pipe:
            for zone in zones:
                keys = [_claimed_key(zone), _queue_key(zone)]
                keys += [_lane_key(zone, lane) for lane in lanes]
                await script(keys, [now, limit], client=pipe)
            replies = await pipe.execute()
        sizes: dict[str, int] = {}
        due: list[list[tuple[float, str, str]]] = [[] for _ in lanes]
        for zone, reply in zip(zones, replies, strict=True):
            sizes[zone] = int(reply[0])
            for li, found in enumerate(reply[1:]):
                due[li] += [(float(found[i + 1]), zone, str(found[i])) for i in range(0, len(found), 2)]
        return sizes, due

    async def _tidy_queued_zones(self, listed: set[str], sizes: dict[str, int]) -> None:
        for zone, size in sizes.items():
            if size and zone not in listed:
                await self._add_queued_zone(zone)
            elif not size and zone in listed:
                await self._drop_queued_zone(zone)

    @_translated
    async def _drop_queued_zone(self, zone: str) -> None:
        await self._r.srem(_QUEUED_ZONES, zone)
        # An enqueue may have written after our look and added the zone before our SREM.
        if await self._r.scard(_queue_key(zone)):
            await self._r.sadd(_QUEUED_ZONES, zone)

    @_translated
    async def _claim_zone(
        self, zone: str, lanes: list[str], counts: list[int], total: int, now: float, until: float
    ) -> tuple[int, list[tuple[int, float, str, str, Claimed]]]:
        keys = [_claimed_key(zone), _queue_key(zone)]
        keys += [_lane_key(zone, lane) for lane in lanes]
        # A token per call, the same in a retried run: it recognises its own claims.
        args = [now, until, total, _zone_prefix(zone), secrets.token_hex(8), *counts]
        # Undecoded: the message content is bytes, not necessarily UTF-8.
        size, entries = await self._eval(self._claim, keys, args, raw=True)
        out: list[tuple[int, float, str, str, Claimed]] = []
        for key, li, due, data, sender, recipients, content, priority, utf8 in entries:
            record = Record.from_dict(json.loads(data))
            message = QueuedMessage(
                sender.decode(), tuple(json.loads(recipients)), bytes(content), int(priority), utf8 == b"1"
            )
            out.append((int(li) - 1, float(due), zone, key.decode(), Claimed(record, message)))
        return int(size), out


def _plan(due: list[list[tuple[float, str, str]]], counts: list[int], total: int) -> dict[str, list[int]]:
    """How many entries each zone gives from each lane: the SQLite backend's choice (each
    lane's quota of the oldest due, then the rest of the total from the lanes in order) made
    over the (due, zone, key) entries peeked from every zone."""
    for entries in due:
        entries.sort()
    taken = [min(n, len(entries)) for n, entries in zip(counts, due, strict=True)]
    room = total - sum(taken)
    for li, entries in enumerate(due):
        if room <= 0:
            break
        more = min(room, len(entries) - taken[li])
        taken[li] += more
        room -= more
    plan: dict[str, list[int]] = {}
    for li, entries in enumerate(due):
        for _, zone, _ in entries[: taken[li]]:
            plan.setdefault(zone, [0] * len(counts))[li] += 1
    return plan
