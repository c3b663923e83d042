"""Closing an asyncio listener that smtpguard opened for itself (metrics, events mailbox)."""

from __future__ import annotations

import asyncio
import contextlib

CLOSE_GRACE = 2.0
"""Seconds a closed listener's open connections get to finish before the stop goes on
without them: a client that holds its connection open must not hold up a shutdown."""


async def close_server(server: asyncio.Server) -> None:
    """Stop accepting, then wait (at most CLOSE_GRACE) for the open connections to end."""
    server.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(server.wait_closed(), CLOSE_GRACE)
