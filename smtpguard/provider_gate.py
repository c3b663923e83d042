"""Fleet-wide provider throttling for one instance (DESIGN.md §16): the store adapter around
policy/throttle.py.

ProviderGate answers the route's question "may a message go to this provider now?" from
three shared facts: the provider's throttle (a rate-limit reply, kept in the store with its
end), its next `max_rate` send slot, and — through ConnectionSlots, which the provider's
pool asks before it opens a connection — its `max_connections` leases.

The throttle flags are read from the store at most once per REFRESH seconds (and at once
by the instance that set one), so a throttle reaches every instance within a second at the
cost of one read per second, not one per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from smtpguard.background import keep
from smtpguard.policy.throttle import CONNECTION_WAIT, RATE_WAIT, ProviderLimits, blocked_until
from smtpguard.replies import Reply
from smtpguard.store import Store, StoreUnavailable

log = logging.getLogger("smtpguard.throttle")

REFRESH = 1.0
"""Seconds between two reads of the shared throttle flags."""
CONNECTION_LEASE = 15.0
"""A connection slot's lease: renewed while the connection is open, so a crashed
instance's slots are free again this long after it died."""
IDLE_HOLD = 1.0
"""A pooled connection idle this long gives its slot back (it is closed): an idle instance
must not keep another from the provider."""
_TICK = 0.5


class ProviderGate:
    def __init__(
        self,
        store: Store,
        limits: Mapping[str, ProviderLimits],
        clock: Callable[[], float] = time.time,
        on_throttled: Callable[[str, bool], None] | None = None,
        on_rate_limited: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.limits = dict(limits)
        self._clock = clock
        self._on_throttled = on_throttled
        self._on_rate_limited = on_rate_limited
        self._throttled: dict[str, float] = {}
        self._read_at: float | None = None
        for name in self.limits:
            self._publish(name, False)

    # --- the throttle flag -------------------------------------------------------------------
    async def refresh(self, force: bool = False) -> None:
        """Read the shared flags if the last read is older than REFRESH. A store that does not
        answer leaves what this instance knew: the relay hears of the store on its own."""
        mono = time.monotonic()
        if not force and self._read_at is not None and mono - self._read_at < REFRESH:
            return
        self._read_at = mono
        now = self._clock()
        try:
            fresh = await self.store.throttled(now)
        except StoreUnavailable:
            return
        known = {n: u for n, u in self._throttled.items() if u > now}
        for name, until in fresh.items():
            known[name] = max(until, known.get(name, 0.0))
        before = set(self._throttled)
        self._throttled = known
        for name in before | set(known):
            self._publish(name, name in known)

    def throttled_until(self, name: str) -> float | None:
        """The end of the provider's throttle, as last read (None: not throttled)."""
        until = self._throttled.get(name)
        return until if until is not None and until > self._clock() else None

    async def blocked(self, name: str) -> float | None:
        await self.refresh()
        return self.throttled_until(name)

    async def blocked_route(self, names: Iterable[str]) -> float | None:
        """When the first of `names` is usable again, if every one is throttled now."""
        await self.refresh()
        return blocked_until(self._throttled, names, self._clock())

    async def throttle(self, name: str, reply: Reply | None) -> float:
        """A rate-limit reply from `name`: throttle it for every instance; returns the end."""
        backoff = self.limits.get(name, ProviderLimits()).backoff
        until = self._clock() + backoff
        first = self.throttled_until(name) is None
        self._throttled[name] = max(until, self._throttled.get(name, 0.0))
        self._publish(name, True)
        if self._on_rate_limited is not None:
            self._on_rate_limited(name)
        if first:
            log.warning(
                "provider asks to slow down; throttled on every instance",
                extra={
                    "provider": name,
                    "upstream_reply": str(reply) if reply else "",
                    "throttle_backoff": backoff,
                },
            )
        try:
            await self.store.set_throttled(name, until)
        except StoreUnavailable as e:
            log.warning(
                "could not share the throttle; this instance keeps it",
                extra={"provider": name, "error": str(e)},
            )
        return until

    # --- max_rate ----------------------------------------------------------------------------
    async def admit(self, name: str) -> float | None:
        """Take the provider's next send slot, waiting for it when it is near: None once the
        message may go, else the time from which a slot may be had. Raises StoreUnavailable
        (nothing is sent without the store)."""
        limits = self.limits.get(name)
        interval = limits.interval if limits is not None else None
        if interval is None:
            return None
        slot = await self.store.rate_slot(name, interval, RATE_WAIT, self._clock())
        if not slot.granted:
            return self._clock() + slot.wait
        if slot.wait > 0:
            await asyncio.sleep(slot.wait)
        return None

    def _publish(self, name: str, throttled: bool) -> None:
        if self._on_throttled is not None:
            self._on_throttled(name, throttled)


@dataclass(eq=False, repr=False)
class ConnectionSlots:
    """max_connections for one provider: each open connection holds a leased slot in the
    store, renewed while it is open; the provider's pool asks for one before it connects."""

    store: Store
    provider: str
    limit: int
    instance: str
    clock: Callable[[], float]
    _seq: Iterator[int] = field(init=False, default_factory=lambda: itertools.count(1))
    _pool: str = field(init=False, default_factory=lambda: secrets.token_hex(4))
    """Tells this pool's holders from those of the pool a reload replaced (same instance
    and provider, its connections possibly still sending): a shared id would "renew"
    the other's slot and let two connections count as one."""
    _held: set[str] = field(init=False, default_factory=set)
    _task: asyncio.Task[None] | None = field(init=False, default=None)
    _releases: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    on_tick: Callable[[], None] | None = field(init=False, default=None)
    """Called every tick while slots are held: the pool closes connections idle too long."""

    async def acquire(self, wait: float = CONNECTION_WAIT) -> str | None:
        """A slot's holder id, waiting up to `wait` for one; None when none came free."""
        holder = f"{self.instance}:{self.provider}:{self._pool}:{next(self._seq)}"
        deadline = time.monotonic() + wait
        while True:
            now = self.clock()
            if await self.store.hold_connection(
                self.provider, holder, self.limit, now + CONNECTION_LEASE, now
            ):
                self._held.add(holder)
                self._start()
                return holder
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)

    def release(self, holder: str) -> None:
        """The connection closed: give its slot back (in the background: closing is sync)."""
        if holder not in self._held:
            return
        self._held.discard(holder)
        keep(self._releases, self._drop(holder))

    async def _drop(self, holder: str) -> None:
        with contextlib.suppress(StoreUnavailable):  # else its lease ends by itself
            await self.store.drop_connection(self.provider, holder)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        renewed = time.monotonic()
        while self._held:
            await asyncio.sleep(_TICK)
            if self.on_tick is not None:
                self.on_tick()
            if time.monotonic() - renewed < CONNECTION_LEASE / 3:
                continue
            renewed = time.monotonic()
            now = self.clock()
            for holder in list(self._held):
                try:
                    kept = await self.store.hold_connection(
                        self.provider, holder, self.limit, now + CONNECTION_LEASE, now
                    )
                except StoreUnavailable:
                    continue
                if not kept:
                    log.warning(
                        "a connection's slot lapsed (the store was away longer than its lease)",
                        extra={"provider": self.provider},
                    )

    async def close(self) -> None:
        """The pool is closed (a reload replaced it, or shutdown): wait for the slots of its
        closed connections to go back. A connection still sending keeps its slot, renewed,
        until it finishes and is discarded: given back now, the new pool could open one
        more than max_connections while it is still open."""
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=2)
