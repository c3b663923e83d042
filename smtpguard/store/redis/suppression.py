"""The Redis store's suppression lists: a zone's and the global one, each a hash keyed by
policy/senders.suppression_key, with a version counter moved by every change."""

from __future__ import annotations

import json

from smtpguard.policy.senders import normalize_address, suppression_key
from smtpguard.store.base import Suppression
from smtpguard.store.redis.connection import RedisConnection, _translated
from smtpguard.store.redis.keys import _supp_key, _supp_version_key


class Suppressions(RedisConnection):
    @_translated
    async def suppressed(self, zone: str, address: str) -> str | None:
        # The folded key, and the address as an earlier version keyed it until the
        # background fold has re-keyed every list (_fold_suppression_keys).
        forms = {suppression_key(address), normalize_address(address)}
        # Two slots (the zone's and global's): a plain pipeline, one round trip, no MULTI.
        async with self._r.pipeline(transaction=False) as pipe:
            for owner in (zone, "global"):
                for form in forms:
                    pipe.hexists(_supp_key(owner), form)
            found = await pipe.execute()
        n = len(forms)
        if any(found[:n]):
            return zone
        return "global" if any(found[n:]) else None

    @_translated
    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        entry = json.dumps({"reason": reason, "at": now}, separators=(",", ":"))
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hsetnx(_supp_key(zone), suppression_key(address), entry)
            pipe.incr(_supp_version_key(zone))
            added, _ = await pipe.execute()
        return bool(added)

    @_translated
    async def suppress_remove(self, zone: str, address: str) -> bool:
        forms = {suppression_key(address), normalize_address(address)}
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hdel(_supp_key(zone), *forms)
            pipe.incr(_supp_version_key(zone))
            removed, _ = await pipe.execute()
        return bool(removed)

    @_translated
    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        # Two slots (the zone's and global's): a plain pipeline, no transaction.
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.get(_supp_version_key(zone))
            pipe.get(_supp_version_key("global"))
            own, shared = await pipe.execute()
        return int(own or 0), int(shared or 0)

    @_translated
    async def suppress_list(self, zone: str) -> list[Suppression]:
        entries = await self._r.hgetall(_supp_key(zone))
        result = []
        for address, raw in sorted(entries.items()):
            entry = json.loads(raw)
            result.append(Suppression(zone, str(address), str(entry["reason"]), float(entry["at"])))
        return result
