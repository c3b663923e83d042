"""Connection caps of the side listeners: the events webhooks, the console, the mailbox.

Each of them is open to strangers (providers, browsers, other MTAs) and each connection
costs a file descriptor. Without a cap, idle connections to one of them use up the
process's descriptors and the SMTP submission listener, in the same process, stops
accepting. So every side listener admits at most `max_connections` at once, and at most
`max_connections_per_ip` from one client address, refused at accept, before a byte is read.

An IPv6 client is counted by its /64: one host usually holds a whole /64, so counting
single addresses would give it 2^64 per-address allowances.

The side listeners run in one process (worker 0, workers.py), so the counts are plain
in-memory counters; the SMTP listener's own counts are global across workers
(connection_table.py) and are not these.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from smtpguard.policy.http_trust import limit_unit


class ListenerLimits(Protocol):
    """A side listener's caps and deadlines, read-only. Its config section is one: the
    fields, their meaning and their defaults are config.events.SideListenerLimits."""

    @property
    def max_connections(self) -> int: ...
    @property
    def max_connections_per_ip(self) -> int: ...
    @property
    def read_timeout(self) -> float: ...
    @property
    def idle_timeout(self) -> float: ...


def peer_ip(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


WARN_EVERY = 60.0
"""A listener at its cap says so in the log at most this often (an attack is not a log flood)."""


class Admission:
    """Open connections of one listener, in total and per client; admit or refuse."""

    def __init__(self, limits: ListenerLimits, name: str = "", logger: str = "smtpguard") -> None:
        self.limits = limits
        self.name = name
        """The listener's config section (events, console, events.mailbox): log lines name it."""
        self.logger = logger
        self.total = 0
        self.per_client: Counter[str] = Counter()
        self.refused = 0
        self._warned = -WARN_EVERY

    def admit(self, ip: str) -> str | None:
        """The bucket the connection is counted under, or None when it is refused."""
        bucket = limit_unit(ip)
        if (
            self.total >= self.limits.max_connections
            or self.per_client[bucket] >= self.limits.max_connections_per_ip
        ):
            self.refused += 1
            self._warn(ip)
            return None
        self.total += 1
        self.per_client[bucket] += 1
        return bucket

    def release(self, bucket: str) -> None:
        self.total = max(self.total - 1, 0)
        self.per_client[bucket] -= 1
        if self.per_client[bucket] <= 0:
            del self.per_client[bucket]

    def _warn(self, ip: str) -> None:
        now = time.monotonic()
        if now - self._warned < WARN_EVERY:
            return
        self._warned = now
        logging.getLogger(self.logger).warning(
            "connection refused: the listener is at its connection cap",
            extra={
                "listener": self.name,
                "client_ip": ip,
                "open": self.total,
                "refused": self.refused,
                "max_connections": self.limits.max_connections,
                "max_connections_per_ip": self.limits.max_connections_per_ip,
            },
        )


class Timer:
    """At most one pending call on the loop: arming again replaces the pending call, and the
    timer forgets it before it runs, so the call may arm the timer anew."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self, delay: float, then: Callable[[], None]) -> None:
        self.disarm()
        self._handle = self._loop.call_later(delay, self._fire, then)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self, then: Callable[[], None]) -> None:
        self._handle = None
        then()


class WriteDeadline:
    """A side listener's client must take what is written to it. While asyncio has paused
    writing (the socket's buffers are full: the client sends but does not read), the
    connection has `seconds` (the listener's read_timeout) before `expired` is called. A
    client that sends whole requests in time and never reads the answers is outside every
    other deadline, and would hold its connection (and its slot) for good.

    `expired` must abort the transport, not close it: close() waits for the buffered
    answers to be read, which is what never happens."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, expired: Callable[[], None]) -> None:
        self._seconds = seconds
        self._expired = expired
        self._timer = Timer(loop)

    def paused(self) -> None:
        if not self._timer.armed:
            self._timer.arm(self._seconds, self._expired)

    def resumed(self) -> None:
        self._timer.disarm()


class WriteDeadlineProtocol(asyncio.BaseProtocol):
    """asyncio's flow control for a side listener's connection: while writing to an admitted
    connection is paused, its WriteDeadline runs (a refused one is closed already)."""

    _writing: WriteDeadline
    _bucket: str | None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._bucket is not None:
            self._writing.paused()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._writing.resumed()
