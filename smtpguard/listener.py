"""aiosmtpd adapter: session hooks gather inputs, ask policy/ (through submission.py), reply.

aiosmtpd ≥ 1.4.6 is the SMTP engine; GuardSMTP narrows it where smtpguard's contract is
stricter: connection limits, bare LF in commands, enhanced codes on aiosmtpd's own replies.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, AnyStr

from aiosmtpd.smtp import SMTP, AuthResult, Envelope, Session

from smtpguard import replies
from smtpguard.config import Config, plan_send_as
from smtpguard.passwords import Verifier
from smtpguard.policy.senders import address_problem, normalize_address, sender_allowed
from smtpguard.replies import Reply
from smtpguard.store import Store, StoreUnavailable
from smtpguard.submission import Principal, Result, Submitter

log = logging.getLogger("smtpguard.listener")
_MAX_BOGUS_COMMANDS = 10


class Connections:
    """Open connections, total and per client IP, shared by every listener."""

    def __init__(self) -> None:
        self.total = 0
        self.per_ip: Counter[str] = Counter()

    def admit(self, ip: str, max_total: int, max_per_ip: int) -> bool:
        if self.total >= max_total or self.per_ip[ip] >= max_per_ip:
            return False
        self.total += 1
        self.per_ip[ip] += 1
        return True

    def release(self, ip: str) -> None:
        self.total -= 1
        self.per_ip[ip] -= 1
        if self.per_ip[ip] <= 0:
            del self.per_ip[ip]


class GuardSMTP(SMTP):
    def __init__(self, handler: Handler, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._guard = handler
        self._admitted_ip: str | None = None
        self._refused = False
        self._bogus = 0

    def _cb_client_connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        super()._cb_client_connected(reader, writer)
        original = reader.readuntil

        async def readuntil(separator: bytes = b"\n") -> bytes:
            # Commands must end in CRLF and hold no other CR, LF or NUL (SMTP smuggling and
            # command injection rely on servers that accept bare LF here).
            while True:
                line: bytes = await original(separator)
                if separator != b"\n" or _clean_command(line):
                    return line
                self._bogus += 1
                if self.transport is None:
                    return line
                self._writer.write(f"{replies.BARE_NEWLINE_COMMAND}\r\n".encode())
                if self._bogus >= _MAX_BOGUS_COMMANDS:
                    self.transport.close()
                    return b"QUIT\r\n"

        reader.readuntil = readuntil  # type: ignore[method-assign,assignment]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is None and self._admitted_ip is None:
            assert isinstance(transport, asyncio.WriteTransport)
            peer = transport.get_extra_info("peername")
            ip = str(peer[0]) if peer else "?"
            if not self._guard.admit(ip):
                self._refused = True
                transport.write(f"{replies.GREETING_BUSY}\r\n".encode())
                transport.close()
                return
            self._admitted_ip = ip
        super().connection_made(transport)

    def connection_lost(self, error: Exception | None) -> None:
        if self._refused:
            return
        if self._admitted_ip is not None:
            self._guard.connections.release(self._admitted_ip)
            self._admitted_ip = None
        super().connection_lost(error)

    def eof_received(self) -> bool | None:
        if self._refused:
            return None
        result: bool | None = super().eof_received()
        return result

    async def push(self, status: AnyStr) -> None:
        text = status.decode() if isinstance(status, bytes) else status
        rewrite = replies.AIOSMTPD_REWRITES.get(text)
        await super().push(str(rewrite) if rewrite else text)


def _clean_command(line: bytes) -> bool:
    return (
        line.endswith(b"\r\n") and line.count(b"\r") == 1 and line.count(b"\n") == 1 and b"\x00" not in line
    )


class Handler:
    """aiosmtpd handler: AUTH, MAIL, RCPT, DATA hooks for one smtpguard instance."""

    def __init__(
        self,
        submitter: Submitter,
        store: Store,
        verifier: Verifier,
        on_result: Callable[[Principal | None, Result, float], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.submitter = submitter
        self.store = store
        self.verifier = verifier
        self.connections = Connections()
        self.on_result = on_result
        self.clock = clock
        self.active = 0
        """Submissions between end of DATA and their reply (graceful stop waits for them)."""
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False

    @property
    def config(self) -> Config:
        return self.submitter.config

    def admit(self, ip: str) -> bool:
        limits = self.config.limits
        return not self.draining and self.connections.admit(
            ip, limits.max_connections, limits.max_connections_per_ip
        )

    # --- AUTH --------------------------------------------------------------------------------
    async def auth_PLAIN(self, server: SMTP, args: list[str]) -> AuthResult:
        if len(args) == 1:
            blob = await server.challenge_auth("")
            if not isinstance(blob, bytes):
                return AuthResult(success=False, handled=True)
        else:
            try:
                blob = base64.b64decode(args[1].encode(), validate=True)
            except (binascii.Error, ValueError):
                await server.push("501 5.5.2 Can't decode base64")
                return AuthResult(success=False, handled=True)
        parts = blob.split(b"\x00")
        if len(parts) != 3:
            await server.push("501 5.5.2 Can't split auth value")
            return AuthResult(success=False, handled=True)
        return await self._authenticate(server, parts[1], parts[2])

    async def auth_LOGIN(self, server: SMTP, args: list[str]) -> AuthResult:
        if len(args) == 1:
            login = await server.challenge_auth("Username:")
            if not isinstance(login, bytes):
                return AuthResult(success=False, handled=True)
        else:
            try:
                login = base64.b64decode(args[1].encode(), validate=True)
            except (binascii.Error, ValueError):
                await server.push("501 5.5.2 Can't decode base64")
                return AuthResult(success=False, handled=True)
        password = await server.challenge_auth("Password:")
        if not isinstance(password, bytes):
            return AuthResult(success=False, handled=True)
        return await self._authenticate(server, login, password)

    async def _authenticate(self, server: SMTP, login: bytes, password: bytes) -> AuthResult:
        limits = self.config.limits
        ip = _peer_ip(server.session)
        try:
            if (
                await self.store.auth_failures(ip, self.clock(), limits.auth_failure_window)
                >= limits.auth_failures
            ):
                return await self._lock_out(server, ip)
            username = login.decode("utf-8", "replace")
            found = self.config.user_zone(username)
            ok = await self.verifier.verify(
                username,
                found[1].password_hash if found else None,
                password.decode("utf-8", "surrogateescape"),
            )
            if ok and found:
                return AuthResult(success=True, auth_data=Principal(found[0], username))
            failures = await self.store.auth_failure(ip, self.clock(), limits.auth_failure_window)
        except StoreUnavailable:
            return AuthResult(success=False, handled=False, message=str(replies.STORE_UNAVAILABLE))
        log.info("authentication failed", extra={"client_ip": ip, "failures": failures})
        if failures >= limits.auth_failures:
            return await self._lock_out(server, ip)
        return AuthResult(success=False, handled=False, message=str(replies.AUTH_INVALID))

    async def _lock_out(self, server: SMTP, ip: str) -> AuthResult:
        log.warning("AUTH locked out", extra={"client_ip": ip})
        await server.push(str(replies.AUTH_LOCKED))
        if server.transport is not None:
            server.transport.close()
        return AuthResult(success=False, handled=True)

    # --- envelope ----------------------------------------------------------------------------
    async def handle_MAIL(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        mail_options: list[str],
    ) -> str:
        principal = session.auth_data
        if not isinstance(principal, Principal):
            return str(replies.AUTH_REQUIRED)
        zone = self.config.zones.get(principal.zone)
        if zone is None or not plan_send_as(zone):
            return self._refuse(principal, replies.send_as_disabled(principal.zone))
        problem = address_problem(address)
        if problem:
            return self._refuse(
                principal,
                replies.bad_address("sender", problem)
                if address
                else replies.sender_not_allowed(address, principal.zone),
            )
        if not sender_allowed(address, zone.senders):
            return self._refuse(principal, replies.sender_not_allowed(address, principal.zone))
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return str(replies.OK_SENDER)

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        principal = session.auth_data
        if not isinstance(principal, Principal):
            return str(replies.AUTH_REQUIRED)
        limit = self.config.limits.max_recipients
        if len(envelope.rcpt_tos) >= limit:
            return str(replies.too_many_recipients(limit))
        problem = address_problem(address)
        if problem:
            return self._refuse(principal, replies.bad_address("recipient", problem))
        try:
            listed = await self.store.suppressed(principal.zone, address)
        except StoreUnavailable:
            return str(replies.STORE_UNAVAILABLE)
        if listed:
            return self._refuse(principal, replies.suppressed(address, listed))
        envelope.rcpt_tos.append(normalize_address(address))
        envelope.rcpt_options.extend(rcpt_options)
        return str(replies.OK_RECIPIENT)

    def _refuse(self, principal: Principal, reply: Reply) -> str:
        self.on_result(principal, Result(reply, "rejected:envelope"), 0.0)
        return str(reply)

    # --- DATA --------------------------------------------------------------------------------
    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        principal = session.auth_data
        if not isinstance(principal, Principal):
            return str(replies.AUTH_REQUIRED)
        if self.draining:
            return str(replies.SHUTTING_DOWN)
        started = time.perf_counter()
        self.active += 1
        self.idle.clear()
        try:
            result = await self.submitter.submit(
                principal,
                envelope.mail_from,
                list(envelope.rcpt_tos),
                envelope.original_content or b"",
            )
        except Exception:
            log.exception("internal error while handling a submission", extra={"zone": principal.zone})
            result = Result(replies.INTERNAL_ERROR, "internal_error")
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()
        self.on_result(principal, result, time.perf_counter() - started)
        return str(result.reply)


def _peer_ip(session: Session | None) -> str:
    peer = getattr(session, "peer", None)
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "?"
