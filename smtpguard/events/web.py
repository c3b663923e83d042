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
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

from aiohttp import web

from smtpguard.admission import ListenerLimits
from smtpguard.config import LimitsConfig, SideListenerLimits
from smtpguard.events.acceptance import settle_if_accepted
from smtpguard.events.apply import Applied, Applier, log_applied
from smtpguard.events.sources import Rejected, Source, Sources
from smtpguard.http_listener import LimitedListener
from smtpguard.policy import http_trust
from smtpguard.policy.events import Malformed
from smtpguard.store import StoreUnavailable

log = logging.getLogger("smtpguard.events")

MAX_APPLYING = 16
"""Verified requests of one source applied at once; more get 503 and the provider retries.
Per source, so that one source's burst never takes another's turn at the store. Reading a
body holds no such slot: a client trickling its body holds only its own connection, for
at most read_timeout, within the connection caps (http_listener.py)."""

Observe = Callable[[str, str, str], None]
"""(source, type, outcome) → count it."""


@dataclass(eq=False, repr=False)
class EventsServer:
    sources: Sources
    applier: Applier
    max_body: InitVar[int]
    clock: Callable[[], float]
    observe: Observe
    limits: InitVar[ListenerLimits | None] = None
    auth_limits: Callable[[], LimitsConfig] = LimitsConfig
    """`limits.auth_failures` within `auth_failure_window`, as the running config has it."""
    on_verdict: Callable[[str, str], None] = lambda provider, verdict: None
    """(provider, verdict) → smtpguard_verdicts_total, for a webhook that settled a record."""
    _applying: dict[str, asyncio.Semaphore] = field(init=False, default_factory=dict)
    _auth_turns: dict[str, tuple[asyncio.Lock, list[int]]] = field(init=False, default_factory=dict)
    port: int = field(init=False, default=0)
    app: web.Application = field(init=False)
    listener: LimitedListener = field(init=False)

    def __post_init__(self, max_body: int, limits: ListenerLimits | None) -> None:
        self.app = web.Application(client_max_size=max_body)
        self.app.router.add_post("/events/{name}", self._handle)
        self.listener = LimitedListener(self.app, limits or SideListenerLimits(), "events", log.name)

    async def start(self, host: str, port: int) -> None:
        await self.listener.start(host, port)
        self.port = self.listener.port

    async def stop(self) -> None:
        await self.listener.stop()

    async def _handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        source = self.sources.get(name)
        if source is None:
            return _reply(404, f"no event source named {name!r}")
        if source.kind == "postmark":
            refused = await self._basic_auth(request, name, source)
            if refused is not None:
                return refused
        else:
            try:
                source.precheck(request.headers)
            except Rejected as e:
                self.observe(name, "-", f"rejected_{e.status}")
                return _reply(e.status, e.reason)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.observe(name, "-", "too_large")
            return _reply(413, "the body is over events.max_body")
        except (ConnectionError, OSError) as e:
            # The client went away mid-body (or read_timeout closed it): nobody is left to
            # answer, and nothing was applied.
            self.observe(name, "-", "aborted")
            log.info(
                "provider event body aborted",
                extra={"source": name, "client_ip": request.remote, "error": type(e).__name__},
            )
            return _reply(400, "the body was not received whole")
        slots = self._applying.setdefault(name, asyncio.Semaphore(MAX_APPLYING))
        if slots.locked():
            self.observe(name, "-", "busy")
            return _reply(503, "too many requests in progress; retry")
        async with slots:
            return await self._verify_and_apply(request, name, source, body)

    async def _basic_auth(self, request: web.Request, name: str, source: Source) -> web.Response | None:
        """Postmark's webhook credentials are a password anyone can guess at: failures are
        limited per client address like SMTP AUTH (`limits.auth_failures` within
        `auth_failure_window`, then 429), in a count of their own (`events:ADDRESS`), so a
        webhook's guesser cannot lock an SMTP client of the same address out of AUTH.

        The right credentials pass whatever that count says. Postmark sends every
        customer's webhooks from the same few addresses, each with the credentials its
        customer wrote into the webhook URL: a lock that refused the right ones too would let
        any Postmark customer (or anyone behind the same proxy) silence the genuine webhooks
        for as long as they kept sending wrong ones. What a locked guesser still learns from
        200 against 429 is what a long random password (docs/events.md) makes worthless."""
        try:
            source.precheck(request.headers)
            return None
        except Rejected as e:
            refusal = e
        ip = request.remote or "?"
        bucket = f"events:{http_trust.limit_unit(ip)}"
        limits = self.auth_limits()
        window = limits.auth_failure_window
        store = self.applier.store
        async with self._auth_turn(bucket):
            now = self.clock()
            try:
                if await store.auth_failures(bucket, now, window) >= limits.auth_failures:
                    # Counted, not logged: the failure that reached the limit said so, and
                    # a guesser sending as fast as it can must not become as many log lines.
                    self.observe(name, "-", "rejected_429")
                    return _reply(
                        429,
                        "too many failed credentials from this address; retry later",
                        {"Retry-After": str(int(window))},
                    )
                failures = await store.auth_failure(bucket, now, window)
            except StoreUnavailable as e:
                log.error(
                    "provider event not checked: store unavailable", extra={"source": name, "error": str(e)}
                )
                return _reply(503, "store unavailable; retry")
        self.observe(name, "-", f"rejected_{refusal.status}")
        # The reason only, never the header: it carries the password that was tried.
        log.warning(
            "provider event refused: HTTP Basic credentials",
            extra={
                "source": name,
                "client_ip": ip,
                "reason": refusal.reason,
                "failures": failures,
                "limited": failures >= limits.auth_failures,
            },
        )
        return _reply(refusal.status, refusal.reason)

    @contextlib.asynccontextmanager
    async def _auth_turn(self, bucket: str) -> AsyncIterator[None]:
        """One check at a time per address: parallel guesses must not all pass the count
        before the first failure is in it."""
        lock, waiting = self._auth_turns.setdefault(bucket, (asyncio.Lock(), [0]))
        waiting[0] += 1
        try:
            async with lock:
                yield
        finally:
            waiting[0] -= 1
            if not waiting[0]:
                del self._auth_turns[bucket]

    async def _verify_and_apply(
        self, request: web.Request, name: str, source: Source, body: bytes
    ) -> web.Response:
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
                if await settle_if_accepted(
                    self.applier.store, source.kind, name, event, outcome, record, self.clock
                ):
                    self.on_verdict(source.provider, "accepted")
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


def _reply(status: int, reason: str, headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"status": "error", "error": reason}
    return web.json_response(body, status=status, headers=headers)
