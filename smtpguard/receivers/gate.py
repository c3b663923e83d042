"""Shaping one zone's mail per receiving provider (DESIGN.md §21): `paused` and `max_rate`.

A receiver is paused by the config (`zones.Z.receivers.R.paused`) or by `smtpguard pause Z
--receiver R`, which writes the pause beside the message-class pauses in the store's zone
controls; this instance reads them through the same ClassPauses copy, at most REFRESH
(0.5 s) old, so a pause holds on every instance within a second. `max_rate` is a GCRA in the
store, the same operation as a provider's `max_rate` (§16), so every instance shares it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from smtpguard.class_pauses import HOLD, ClassPauses
from smtpguard.policy import receivers
from smtpguard.policy.receivers import RCPT_BURST, Shaping
from smtpguard.replies import Reply
from smtpguard.store import Store, StoreUnavailable

log = logging.getLogger("smtpguard.receivers")

PAUSE_HOLD = HOLD
"""Seconds a queued entry held by a paused receiver waits before it is looked at again: a
class pause's (a paused receiver may hold a large backlog); `resume --receiver` wakes the
held entries at once."""

MAX_BANKED = 10_000
"""Queued entries whose gathered slots are kept at once; the oldest go first."""


def slot_name(zone: str, receiver: str) -> str:
    """The GCRA's name in the store: beside the providers' (whose names have no colon)."""
    return f"receiver:{zone}:{receiver}"


@dataclass(eq=False)
class ReceiverGate:
    store: Store
    pauses: ClassPauses
    shaping: Callable[[], Mapping[str, Mapping[str, Shaping]]]
    """zone → receiver → its settings, read anew each time (a reload replaces them)."""
    clock: Callable[[], float]
    _banked: OrderedDict[tuple[str, str, str], int] = field(init=False, default_factory=OrderedDict)
    """(zone, entry key, receiver) → send slots a queued entry holds from earlier tries."""
    _lines: dict[tuple[str, str], float] = field(init=False, default_factory=dict)
    """(zone, receiver) → when the last turn given to a refused queued entry ends."""

    async def paused(self, zone: str, receiver: str) -> bool:
        own = self.shaping().get(zone, {}).get(receiver)
        if own is not None and own.paused:
            return True
        try:
            pairs = await self.pauses.paused()
        except StoreUnavailable:
            return False  # the store's pause cannot be read: the reservation will say so
        return (zone, receivers.control_name(receiver)) in pairs

    async def slot(self, zone: str, receiver: str) -> tuple[bool, float] | None:
        """Take one of the receiver's send slots: (granted, seconds until one could be had);
        None when it has no max_rate (or the store cannot be asked: shaping never refuses
        mail the store would take)."""
        own = self.shaping().get(zone, {}).get(receiver)
        interval = own.interval if own is not None else None
        if interval is None:
            return None
        now = self.clock()
        if own is not None and own.on_alert == "slow" and await self._slowed(zone, receiver):
            interval *= 2
        try:
            slot = await self.store.rate_slot(slot_name(zone, receiver), interval, RCPT_BURST, now)
        except StoreUnavailable:
            return None
        return slot.granted, slot.wait

    async def _slowed(self, zone: str, receiver: str) -> bool:
        """`on_alert: slow` in force (the store's control, which the alert judge sets)."""
        try:
            pairs = await self.pauses.paused()
        except StoreUnavailable:
            return False
        return (zone, receivers.slow_control(receiver)) in pairs

    async def rcpt_refusal(self, zone: str, receiver: str) -> Reply | None:
        """Relay mode: `451 4.7.1` for this recipient while its receiver is paused or over
        its max_rate; None to take it."""
        if await self.paused(zone, receiver):
            return receivers.rcpt_refusal(receiver, True, None)
        slot = await self.slot(zone, receiver)
        return receivers.rcpt_refusal(receiver, False, None if slot is None else slot[0])

    async def hold_until(self, zone: str, entry: str, recipients_of: Mapping[str, int]) -> float | None:
        """Queue mode: when the entry `entry` whose recipients are of these receivers
        (receiver → how many) may be tried again, or None to send it now.

        One slot per recipient, gathered across tries: the slots a try was granted are kept
        for the entry (banked) when another is refused, so an entry with more of a
        receiver's recipients than one burst holds goes once it has them all, instead of
        spending one slot each try and waiting again for ever."""
        now = self.clock()
        for receiver in recipients_of:
            if await self.paused(zone, receiver):
                return now + PAUSE_HOLD
        for receiver, n in recipients_of.items():
            banked = (zone, entry, receiver)
            have = self._banked.pop(banked, 0)
            while have < n:
                slot = await self.slot(zone, receiver)
                if slot is None:
                    have = n  # no max_rate (or no store to ask): nothing to gather
                elif slot[0]:
                    have += 1
                else:
                    self._bank(banked, have)
                    return self._turn(zone, receiver, now, slot[1])
            if have:
                self._bank(banked, have)
        for receiver in recipients_of:
            self._banked.pop((zone, entry, receiver), None)
        return None

    def _turn(self, zone: str, receiver: str, now: float, wait: float) -> float:
        own = self.shaping().get(zone, {}).get(receiver)
        interval = (own.interval if own is not None else None) or 0.0
        turn, self._lines[(zone, receiver)] = receivers.next_turn(
            self._lines.get((zone, receiver)), now, wait, interval
        )
        return turn

    def _bank(self, banked: tuple[str, str, str], have: int) -> None:
        self._banked[banked] = have
        # Bounded: an entry claimed elsewhere next time never comes back for its slots here
        # (they are spent, never handed out twice: shaping errs on the slow side).
        while len(self._banked) > MAX_BANKED:
            self._banked.popitem(last=False)
