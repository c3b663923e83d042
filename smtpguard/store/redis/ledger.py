"""The Redis store's ledger writes: each one script, atomic in the zone's slot (the
reservation with its caps, CAS puts, the queue's enqueue and requeue, refunds), and purge."""

from __future__ import annotations

import json
import time
from typing import Any

from smtpguard.policy.ledger import Record, State
from smtpguard.policy.limits import HOUR, WINDOW_KEEP, CapCheck, CapReached
from smtpguard.store.base import Conflict, Paused, QueuedMessage, Reserved, ReserveResult, entry_columns
from smtpguard.store.redis.connection import _PURGE_BATCH, RedisConnection, _translated
from smtpguard.store.redis.keys import (
    _ZONE_ANNOUNCE_EVERY,
    _ZONES,
    _claimed_key,
    _entry_key,
    _event_ids_key,
    _ids,
    _index_key,
    _lane_key,
    _month_key,
    _paused_key,
    _queue_key,
    _record_key,
    _sends_key,
    _user_args,
    _user_keys,
    _user_tokens_key,
    _zone_prefix,
)

_MONTH_TTL = 40 * 86400
_SETTLED_EXCLUDED = (State.IN_FLIGHT.value, State.QUEUED.value)


def _reached(cap: CapCheck, reply: list[Any]) -> CapReached:
    """The refusal a cap script answered: the zone's month or hour, or the user's."""
    verdict = reply[0]
    user = cap.user if verdict in ("umonth", "uhour") else None
    caps = cap.user_caps if user is not None and cap.user_caps is not None else cap.caps
    if verdict in ("month", "umonth"):
        return CapReached("month", caps.monthly, user=user)
    oldest = float(reply[1]) if reply[1] else None
    return CapReached("hour", caps.hourly, (oldest or cap.now) + HOUR, user=user)


def _load(data: str | None) -> Record | None:
    return Record.from_dict(json.loads(data)) if data else None


def _cas_args(r: Record, expected_version: int | None) -> list[str | float]:
    """ARGV[1] to ARGV[6] of lib/cas_write.lua: `r` written over `expected_version`."""
    expected = "" if expected_version is None else str(expected_version)
    return [expected, str(r.version), r.state.value, _dump(r), r.updated_at, r.key]


def _queue_keys(zone: str, key: str) -> list[str]:
    """KEYS[1] to KEYS[5] of enqueue.lua and requeue.lua."""
    record, entry = _record_key(zone, key), _entry_key(zone, key)
    return [record, _index_key(zone), entry, _claimed_key(zone), _queue_key(zone)]


def _swapped(reply: list[Any]) -> Conflict | None:
    """What a script built on lib/cas_write.lua answered: written, or the current record."""
    return None if reply[0] == "ok" else Conflict(_load(reply[1]))


def _dump(r: Record) -> str:
    return json.dumps(r.to_dict(), separators=(",", ":"))


class Ledger(RedisConnection):
    _zones_announced: dict[str, float]

    async def _announce_zone(self, zone: str) -> None:
        """Record the zone in the zone set purge walks; at most every few minutes per process."""
        now = time.monotonic()
        last = self._zones_announced.get(zone)
        if last is not None and now - last < _ZONE_ANNOUNCE_EVERY:
            return
        # Marked first, so a burst of new keys sends one SADD, not one each.
        self._zones_announced[zone] = now
        try:
            await self._r.sadd(_ZONES, zone)
        except BaseException:
            self._zones_announced.pop(zone, None)
            raise

    @_translated
    async def get(self, zone: str, key: str) -> Record | None:
        data = await self._r.hget(_record_key(zone, key), "d")
        return _load(data if isinstance(data, str) else None)

    @_translated
    async def reserve(
        self, record: Record, expected_version: int | None, cap: CapCheck | None, paused: bool
    ) -> ReserveResult:
        zone = record.zone
        await self._announce_zone(zone)
        cap_zone = cap.zone if cap is not None else zone
        month = cap.month if cap is not None else "-"
        keys = [
            _record_key(zone, record.key),
            _paused_key(zone),
            _sends_key(cap_zone),
            _month_key(cap_zone, month),
            _index_key(zone),
            *_user_keys(cap_zone, cap),
        ]
        args: list[str | int | float] = [
            "" if expected_version is None else str(expected_version),
            "1" if paused else "0",
            "1" if cap is not None else "0",
            cap.caps.monthly if cap is not None else 0,
            cap.caps.hourly if cap is not None else 0,
            cap.hour_start if cap is not None else 0.0,
            cap.token if cap is not None else "",
            cap.now if cap is not None else 0.0,
            cap.now - WINDOW_KEEP if cap is not None else 0.0,
            _MONTH_TTL,
            str(record.version),
            record.state.value,
            _dump(record),
            record.updated_at,
            record.key,
            *_user_args(cap),
            *_ids(record),
        ]
        reply = await self._eval(self._reserve, keys, args, replicated=True)
        verdict = reply[0]
        if verdict == "ok":
            return Reserved()
        if verdict == "conflict":
            return Conflict(_load(reply[1]))
        if verdict == "paused":
            return Paused()
        assert cap is not None
        return _reached(cap, reply)

    @_translated
    async def put(self, record: Record, expected_version: int | None) -> Conflict | None:
        if expected_version is None:
            await self._announce_zone(record.zone)
        keys = [_record_key(record.zone, record.key), _index_key(record.zone)]
        args = [
            *_cas_args(record, expected_version),
            *_ids(record),
        ]
        reply = await self._eval(self._put, keys, args, replicated=True)
        return _swapped(reply)

    @_translated
    async def refund(self, zone: str, token: str, month: str) -> None:
        keys = [_sends_key(zone), _month_key(zone, month), _user_tokens_key(zone)]
        await self._eval(self._refund, keys, [token, _zone_prefix(zone), month])

    async def purge(self, now: float, retention: float) -> int:
        # Not one deadline for the whole purge: each round trip below has its own.
        cutoff = now - retention
        deleted = 0
        for zone in await self._known_zones():
            offset = 0
            while True:
                members = await self._purge_candidates(zone, cutoff, offset)
                if not members:
                    break
                done, kept = await self._purge_batch(zone, cutoff, now, members)
                deleted += done
                # Old records still in_flight, queued or waiting deferred in their lane stay
                # in the index: step over them.
                offset += kept
                if len(members) < _PURGE_BATCH:
                    break
            await self._trim_window(zone, now - WINDOW_KEEP)
            await self._trim_event_ids(zone, cutoff)
        # AUTH failure keys expire by themselves (see auth_failure).
        return deleted

    @_translated
    async def _purge_candidates(self, zone: str, cutoff: float, offset: int) -> list[str]:
        members = await self._r.zrangebyscore(
            _index_key(zone), "-inf", f"({cutoff!r}", start=offset, num=_PURGE_BATCH
        )
        return [str(m) for m in members]

    @_translated
    async def _purge_batch(self, zone: str, cutoff: float, now: float, members: list[str]) -> tuple[int, int]:
        keys = [_index_key(zone), *(_record_key(zone, m) for m in members)]
        args = [cutoff, now, *_SETTLED_EXCLUDED, State.DEFERRED.value, *members]
        done, kept = await self._eval(self._purge, keys, args)
        return int(done), int(kept)

    @_translated
    async def _trim_event_ids(self, zone: str, before: float) -> None:
        await self._r.zremrangebyscore(_event_ids_key(zone), "-inf", f"({before!r}")

    @_translated
    async def _trim_window(self, zone: str, before: float) -> None:
        await self._r.zremrangebyscore(_sends_key(zone), "-inf", f"({before!r}")
        # The user units' token map: entries past any window that reads them (the user
        # windows themselves are trimmed by each unit counted).
        tokens = _user_tokens_key(zone)
        old = [t async for t, held in self._r.hscan_iter(tokens) if float(str(held).split("|")[0]) < before]
        if old:
            await self._r.hdel(tokens, *old)

    @_translated
    async def consume_cap(self, cap: CapCheck) -> CapReached | None:
        # Announced so that purge trims the zone's window, as it does for reserve().
        await self._announce_zone(cap.zone)
        keys = [
            _sends_key(cap.zone),
            _month_key(cap.zone, cap.month),
            *_user_keys(cap.zone, cap),
        ]
        args: list[str | int | float] = [
            cap.caps.monthly,
            cap.caps.hourly,
            cap.hour_start,
            cap.token,
            cap.now,
            cap.now - WINDOW_KEEP,
            _MONTH_TTL,
            *_user_args(cap),
        ]
        reply = await self._eval(self._consume, keys, args)
        if reply[0] == "ok":
            return None
        return _reached(cap, reply)

    async def enqueue(
        self, record: Record, expected_version: int | None, message: QueuedMessage
    ) -> Conflict | None:
        conflict = await self._enqueue_entry(record, expected_version, message)
        if conflict is None:
            # After the write: a claim that found the zone's queue empty and is dropping the
            # zone re-checks after its SREM, so one of the two always leaves the zone listed.
            await self._add_queued_zone(record.zone)
        return conflict

    @_translated
    async def _enqueue_entry(
        self, record: Record, expected_version: int | None, message: QueuedMessage
    ) -> Conflict | None:
        zone, lane = record.zone, record.lane or ""
        await self._announce_zone(zone)
        keys = [*_queue_keys(zone, record.key), _lane_key(zone, lane)]
        args: list[str | int | float | bytes] = [
            *_cas_args(record, expected_version),
            _zone_prefix(zone),
            *entry_columns(record, message),
            "1" if message.smtputf8 else "0",
            *_ids(record),
        ]
        reply = await self._eval(self._enqueue, keys, args, replicated=True)
        return _swapped(reply)

    @_translated
    async def requeue(self, record: Record, expected_version: int, due: float | None) -> Conflict | None:
        zone = record.zone
        keys = _queue_keys(zone, record.key)
        args: list[str | float] = [
            *_cas_args(record, expected_version),
            _zone_prefix(zone),
            "" if due is None else due,
            *_ids(record),
        ]
        reply = await self._eval(self._requeue, keys, args, replicated=True)
        return _swapped(reply)
