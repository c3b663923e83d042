"""systemd's readiness protocol (sd_notify(3)) for `Type=notify`: one datagram per state.

Without $NOTIFY_SOCKET (not under systemd, or another Type=) every call is a no-op. The
protocol is a datagram of `KEY=value` lines on an AF_UNIX socket; `@` at the start of the
path names the abstract namespace. No libsystemd binding is needed for that.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("smtpguard.server")


def send(*fields: str) -> bool:
    """Send `fields` (e.g. "READY=1") to systemd; False when there is no one to tell."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or address[0] not in ("/", "@"):
        return False
    target = "\0" + address[1:] if address[0] == "@" else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), target)
    except OSError as e:
        # systemd would then time the start out and say so; the log says why.
        log.warning("could not notify systemd", extra={"socket": address, "error": str(e)})
        return False
    return True


def ready(status: str) -> bool:
    return send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")


def reloading() -> bool:
    # MONOTONIC_USEC lets systemd (Type=notify-reload, 253+) match this to its reload.
    return send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


def stopping() -> bool:
    return send("STOPPING=1", "STATUS=draining in-flight submissions")
