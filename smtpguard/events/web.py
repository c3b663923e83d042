"""The `events` HTTP listener: `POST /events/NAME` for each configured source (§13).

aiohttp's web server parses HTTP (a hand-written parser is how request smuggling starts)
and runs on smtpguard's own event loop, so a webhook's store writes share the process's
store connection. Every request gets one status and nothing partial: the body is read
whole (bounded by `max_body`), verified, and only then are its events applied, each one
atomically and idempotently — so a store failure half way through a batch answers 503 and
the provider's retry applies the rest while the applied ones count as duplicates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from smtpguard.events.apply import Applied, Applier, log_applied
from smtpguard.events.model import Malformed
from smtpguard.events.sources import Rejected, Source, Sources
from smtpguard.store import StoreUnavailable

log = logging.getLogger("smtpguard.events")

MAX_CONCURRENT = 64
"""Requests read and applied at once; more get 503 and the provider retries. Bounds what
unauthenticated clients can hold: MAX_CONCURRENT times max_body of memory."""
READ_TIMEOUT = 30.0

Observe = Callable[[str, str, str], None]
"""(source, type, outcome) → count it."""


class EventsServer:
    def __init__(
        self,
        sources: Sources,
        applier: Applier,
        max_body: int,
        clock: Callable[[], float],
        observe: Observe,
    ) -> None:
        self.sources = sources
        self.applier = applier
        self.clock = clock
        self.observe = observe
        self._runner: web.AppRunner | None = None
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self.port = 0
        self.app = web.Application(client_max_size=max_body)
        self.app.router.add_post("/events/{name}", self._handle)

    async def start(self, host: str, port: int) -> None:
        # No access log: a webhook URL may carry a token in its query string.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        source = self.sources.get(name)
        if source is None:
            return _reply(404, f"no event source named {name!r}")
        try:
            source.precheck(request.headers)
        except Rejected as e:
            self.observe(name, "-", f"rejected_{e.status}")
            return _reply(e.status, e.reason)
        if self._slots.locked():
            self.observe(name, "-", "busy")
            return _reply(503, "too many requests in progress; retry")
        async with self._slots:
            return await self._read_and_apply(request, name, source)

    async def _read_and_apply(self, request: web.Request, name: str, source: Source) -> web.Response:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.observe(name, "-", "too_large")
            return _reply(413, "the body is over events.max_body")
        except TimeoutError:
            self.observe(name, "-", "timeout")
            return _reply(408, "the body did not arrive in time")
        try:
            verified = source.verify(body, request.headers, self.clock())
        except Rejected as e:
            self.observe(name, "-", f"rejected_{e.status}")
            log.warning(
                "provider event refused",
                extra={"source": name, "status": e.status, "reason": e.reason, "peer": request.remote},
            )
            return _reply(e.status, e.reason)
        except Malformed as e:
            self.observe(name, "-", "rejected_400")
            return _reply(400, str(e))
        except Exception as e:
            # A payload no reader here foresaw: refused and logged, never a 500 the
            # provider retries forever, and nothing applied.
            self.observe(name, "-", "rejected_400")
            log.warning(
                "provider event unreadable", extra={"source": name, "error": f"{type(e).__name__}: {e}"[:300]}
            )
            return _reply(400, "the request could not be read")
        if verified.notice:
            log.warning(verified.notice, extra={"source": name})
        counts: dict[str, int] = {o.value: 0 for o in Applied}
        try:
            nonce = verified.nonce
            if nonce is not None and not await self.applier.store.remember_nonce(
                nonce.name, nonce.digest, nonce.until
            ):
                self.observe(name, "-", "rejected_401")
                log.warning(
                    "provider event refused: a signed nonce replayed with another body",
                    extra={"source": name},
                )
                return _reply(401, "the signature's token was used before with another body (a replay)")
            for event in verified.events:
                outcome, record = await self.applier.apply(source.provider, event)
                counts[outcome.value] += 1
                self.observe(name, event.kind.value, outcome.value)
                log_applied(name, event, outcome, record)
        except StoreUnavailable as e:
            log.error(
                "provider event not applied: store unavailable", extra={"source": name, "error": str(e)}
            )
            return _reply(503, "store unavailable; retry")
        if counts.pop(Applied.RETRY_LATER.value):
            # A message still being sent: the provider retries, and the events applied now
            # are duplicates then (DESIGN.md §18).
            return _reply(503, "the message is still being sent; retry")
        return web.json_response({"status": "ok", **counts})


def _reply(status: int, reason: str) -> web.Response:
    body: dict[str, Any] = {"status": "error", "error": reason}
    return web.json_response(body, status=status)
