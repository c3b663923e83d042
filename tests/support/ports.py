"""Free loopback ports for the servers a test starts, that no other test is handed.

Binding port 0 and closing the socket (the usual recipe) gave the same port twice: the kernel
returns a just-closed port again, so one fixture's four ports once held the SMTP listener and
the console on one number (the console won, the SMTP client was refused). Such a port also
lies in the kernel's ephemeral range, where any client's outgoing connection may take it
before the server binds it.

So ports come from below the ephemeral range, each pytest-xdist worker from its own slice,
each handed out once per process (a counter from a per-process offset, so two suites run side
by side start apart), and a port something already holds is passed over.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

LOW = 20000
"""Above the well-known services a test machine runs (PostgreSQL 5432, Redis 6379, 8000s)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    high = max(_ephemeral_low(), LOW + 1000)
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    width = (high - LOW) // workers
    start = LOW + (index % workers) * width
    return range(start, start + width)


def _candidates() -> Iterator[int]:
    span = _slice()
    offset = os.getpid() % len(span)
    for n in itertools.count():
        yield span[(offset + n) % len(span)]


_NEXT = _candidates()
_LOCK = threading.Lock()


def _bindable(port: int) -> bool:
    # Without SO_REUSEADDR a port in TIME_WAIT from an earlier test is passed over too: the
    # servers under test set it and could bind there, but there is no need to find out.
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A loopback port free now for TCP and UDP, not handed out before in this process."""
    with _LOCK:
        for _ in range(len(_slice())):
            port = next(_NEXT)
            if _bindable(port):
                return port
    raise RuntimeError("no free loopback port left in this worker's slice")
