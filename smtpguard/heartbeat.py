"""The heartbeat between the supervisor and each worker of `workers: N` (DESIGN.md §18).

A worker whose event loop stopped turning (SIGSTOP, a blocking call, an endless callback)
still holds its share of the SO_REUSEPORT group: the kernel keeps handing it connections
that no one accepts. A dead worker is noticed by its exit; a wedged one only by its silence.
So the supervisor asks, over one socketpair per worker, and the worker's loop answers,
from the loop itself, so an answer proves the loop runs, not merely that the process
exists. The loop answers from the moment it runs, before the worker opens its store or
listens, and the supervisor asks from the moment it starts the worker: a worker stuck while
it starts is as wedged as one stuck later (its slot would serve no one, and a listener it
opened would take its share of connections); the interpreter's imports before the loop
runs take half a second, far inside the shortest `workers_heartbeat` (10s). No answer for
`workers_heartbeat` and the supervisor kills the worker (SIGKILL: a stopped process cannot
handle SIGTERM), which closes its sockets, and starts another.

Either end seeing the socket closed learns its peer is gone: a worker whose supervisor
died (`kill -9`) hears it at once, without waiting for its once-a-second look at its
parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass

PING = b"?"
ANSWER = b"!"


def ping_interval(heartbeat: float) -> float:
    """How often the supervisor asks: often enough that one late answer is not a miss."""
    return min(1.0, heartbeat / 5)


def _receive(sock: socket.socket) -> bytes | None:
    """What a non-blocking end has to read: None when nothing is waiting, b"" when the
    other end is gone (closed, or the socket failed)."""
    try:
        return sock.recv(4096)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


@dataclass
class Beat:
    """The supervisor's end of one worker's heartbeat."""

    sock: socket.socket
    asked: float = 0.0
    """Monotonic time of the last ping sent."""
    waiting: float | None = None
    """Monotonic time of the oldest ping not answered yet (None: all answered). Silence is
    counted from a ping sent, never from the last answer: a supervisor that was itself
    stopped or starved for a while sent nothing meanwhile, and must not blame its workers."""

    @classmethod
    def pair(cls) -> tuple[Beat, socket.socket]:
        """The supervisor's end, and the worker's end (to pass to it, then close here)."""
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.set_inheritable(True)
        return cls(ours), theirs

    def tick(self, now: float, heartbeat: float) -> float:
        """Collect answers and ask again when due; the seconds an asked ping has waited."""
        # Until nothing is waiting (None) or the worker's end is closed (b""): its exit is
        # noticed by its status.
        while _receive(self.sock):
            self.waiting = None
        if now - self.asked >= ping_interval(heartbeat):
            self.asked = now
            if self.waiting is None:
                self.waiting = now
            # A full buffer: the worker has not read for a while; its silence says so.
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                self.sock.send(PING)
        return 0.0 if self.waiting is None else now - self.waiting

    def restart(self, now: float) -> None:
        """Start asking from now (the worker was just started)."""
        self.asked = now
        self.waiting = now

    def close(self) -> None:
        self.sock.close()


class Answerer:
    """The worker's end: answers every ping from the event loop."""

    def __init__(self, fd: int, on_gone: Callable[[], None]) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.on_gone = on_gone
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.sock.fileno(), self._on_ping)

    def _on_ping(self) -> None:
        got = _receive(self.sock)
        if got is None:
            return
        if not got:
            self.close()
            self.on_gone()
            return
        with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
            self.sock.send(ANSWER)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
