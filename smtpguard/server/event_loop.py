"""Which event loop the server runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from smtpguard.config import ConfigError


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop the server runs on. uvloop (libuv, sockets and timers in C) takes
    about a fifth off smtpguard's CPU time per message; see bench/README.md."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError(
                    [
                        "event_loop: uvloop, but the uvloop package is not installed "
                        "(pip install 'smtpguard[fast]')"
                    ]
                ) from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop
