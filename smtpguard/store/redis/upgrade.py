"""The set-once upgrades of data an earlier version wrote, run in the background at open."""

from __future__ import annotations

import asyncio

from smtpguard.policy.senders import suppression_key
from smtpguard.store.base import StoreUnavailable
from smtpguard.store.redis.connection import _PURGE_BATCH, RedisConnection, _translated
from smtpguard.store.redis.keys import (
    _LANES_LISTED,
    _STATES_LISTED,
    _SUPP_FOLDED,
    _index_key,
    _lanes_key,
    _queue_key,
    _supp_key,
    _supp_version_key,
    _zone_prefix,
)


class Upgrades(RedisConnection):
    async def _upgrade(self) -> None:
        """Once per Redis (a marker each says it is done), for data an earlier version wrote:
        the set of each zone's lane names is filled from its queue entries (the orphan lane
        scan reads it), and suppression entries are re-keyed by policy/senders.
        suppression_key (lookups meanwhile try both forms). In the background, a page at a
        time (a long list outlasts one operation's deadline); idempotent, so instances may
        run it concurrently."""
        while True:
            try:
                if not await self._flag_get(_LANES_LISTED):
                    for zone in await self._known_zones():
                        await self._list_lanes(zone)
                    await self._flag_set(_LANES_LISTED)
                if not await self._flag_get(_STATES_LISTED):
                    for zone in await self._known_zones():
                        await self._list_states(zone)
                    await self._flag_set(_STATES_LISTED)
                if not await self._flag_get(_SUPP_FOLDED):
                    for zone in [*await self._known_zones(), "global"]:
                        await self._fold_zone(zone)
                    await self._flag_set(_SUPP_FOLDED)
                return
            except StoreUnavailable:
                await asyncio.sleep(1.0)

    @_translated
    async def _list_lanes(self, zone: str) -> None:
        await self._eval(self._lanes_of, [_queue_key(zone), _lanes_key(zone)], [_zone_prefix(zone)])

    async def _fold_zone(self, zone: str) -> None:
        cursor = 0
        while True:
            cursor, moved = await self._fold_page(zone, cursor)
            if moved:
                await self._bump_supp(zone)
            if cursor == 0:
                return

    @_translated
    async def _fold_page(self, zone: str, cursor: int) -> tuple[int, bool]:
        key = _supp_key(zone)
        cursor, page = await self._r.hscan(key, cursor, count=500)
        assert isinstance(page, dict)
        stale = {str(a): e for a, e in page.items() if suppression_key(str(a)) != a}
        if stale:
            async with self._r.pipeline(transaction=True) as pipe:
                for address, entry in stale.items():
                    pipe.hsetnx(key, suppression_key(address), entry)
                    pipe.hdel(key, address)
                await pipe.execute()
        return int(cursor), bool(stale)

    @_translated
    async def _bump_supp(self, zone: str) -> None:
        await self._r.incr(_supp_version_key(zone))

    async def _list_states(self, zone: str) -> None:
        # By score, a page per round trip (a zone of a million records outlasts any one
        # operation's deadline): the purge taking old members or writes moving members to
        # the top never shift the cursor, and a record rewritten meanwhile is met again
        # at its new score, which is harmless.
        score, offset = "-inf", 0
        while True:
            found = await self._list_states_page(zone, score, offset)
            if not found:
                return
            last, same = found
            score, offset = (last, offset + same) if last == score else (last, same)

    @_translated
    async def _list_states_page(self, zone: str, score: str, offset: int) -> tuple[str, int] | None:
        reply = await self._eval(self._states_page, [_index_key(zone)], [score, offset, _PURGE_BATCH])
        if not reply:
            return None
        return str(reply[0]), int(reply[1])
