"""aiosmtpd adapter: session hooks gather inputs, ask policy/ (through submission.py), reply.

aiosmtpd ≥ 1.4.6 is the SMTP engine; GuardSMTP narrows it where smtpguard's contract is
stricter: connection limits, bare LF in commands, envelope addresses judged as sent, line
length, idle and DATA timeouts, enhanced codes on aiosmtpd's own replies.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, AnyStr, cast

from aiosmtpd.smtp import MISSING, SMTP, AuthResult, Envelope, Session, TLSSetupException

from smtpguard import replies
from smtpguard.config import Config, plan_send_as
from smtpguard.passwords import Verifier
from smtpguard.policy.senders import (
    address_problem,
    normalize_address,
    route_offers_smtputf8,
    sender_allowed,
    smtputf8_refusal,
)
from smtpguard.recipient_domains import RecipientDomains
from smtpguard.replies import Reply
from smtpguard.store import Store, StoreUnavailable
from smtpguard.submission import Principal, Result, Submitter
from smtpguard.turns import Turns

log = logging.getLogger("smtpguard.listener")
_MAX_BOGUS_COMMANDS = 10
_HANG_UP_GRACE = 5.0
"""Seconds a closing connection may take to flush its last reply before it is aborted (a
client that never reads must not keep the socket open)."""
_READ = Callable[[bytes], Awaitable[bytes]]


# aiosmtpd logs raw client lines. It masks the argument of `AUTH <mech> <response>` itself,
# but not a line it does not know: an AUTH LOGIN username or password becomes one when the
# client sends it after a refused AUTH (538, 421, 501), and a bad base64 answer is logged
# whole. Those lines are replaced before any handler sees the record.
_CLIENT_LINE_ARG: dict[str, tuple[int, bool]] = {
    # message format: (index of the client line in args, always a credential)
    "_handle_client readline: %r": (0, False),
    "%r >> %r": (1, False),
    "%r unrecognised: %s": (1, True),
    "%r can't decode base64: %s": (1, True),
}
_KNOWN_VERBS = frozenset(
    {"EHLO", "HELO", "MAIL", "RCPT", "DATA", "RSET", "NOOP", "QUIT", "STARTTLS", "HELP", "VRFY", "EXPN"}
)


def _redact(line: object) -> object:
    """A client command line as safe to log: known verbs as sent, AUTH with its mechanism
    only, anything else (a stray credential) masked."""
    text = line.decode("ascii", "replace") if isinstance(line, bytes) else str(line)
    words = text.split(None, 2)
    verb = words[0].upper() if words else ""
    if verb in _KNOWN_VERBS:
        return line
    if verb == "AUTH" and len(words) >= 2:
        return f"AUTH {words[1][:20]}" + (" ********" if len(words) > 2 else "")
    return "********"


class _RedactClientSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        where = _CLIENT_LINE_ARG.get(str(record.msg))
        if where is not None and isinstance(record.args, tuple) and where[0] < len(record.args):
            index, always = where
            args = list(record.args)
            args[index] = "********" if always else _redact(args[index])
            record.args = tuple(args)
        return True


logging.getLogger("mail.log").addFilter(_RedactClientSecrets())


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


class GuardSession(Session):
    """aiosmtpd's session with an id that every log line about the connection carries."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.id = secrets.token_hex(6)


class GuardSMTP(SMTP):
    def __init__(self, handler: Handler, **kwargs: Any) -> None:
        limits = handler.config.limits
        # aiosmtpd sizes its StreamReader from this attribute in SMTP.__init__: it bounds every
        # command and DATA line, and with it the memory one line can take.
        self.line_length_limit = limits.max_line_length
        self._data_timeout = limits.data_timeout
        self._long_line = _long_line_pattern(limits.max_line_length)
        self._data_timer: asyncio.TimerHandle | None = None
        self._abort_timer: asyncio.TimerHandle | None = None
        self._last_data = 0.0
        super().__init__(handler, **kwargs)
        self._guard = handler
        self._admitted_ip: str | None = None
        self._refused = False
        self._bogus = 0

    def _create_session(self) -> Session:
        return GuardSession(self.loop)

    def _where(self) -> dict[str, object]:
        """The fields that place a log line: client IP and session id."""
        return {"client_ip": self._admitted_ip, "session": getattr(self.session, "id", None)}

    def _cb_client_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super()._cb_client_connected(reader, writer)
        original = reader.readuntil
        self._read_raw: _READ = original

        async def readuntil(separator: bytes = b"\n") -> bytes:
            # aiosmtpd reads commands (and AUTH responses, through readline) up to LF; the
            # DATA transfer is read by smtp_DATA below.
            return await self._read_command_line(original)

        reader.readuntil = readuntil  # type: ignore[method-assign,assignment]

    async def _read_command_line(self, read: _READ) -> bytes:
        # Commands must end in CRLF and hold no other CR, LF or NUL (SMTP smuggling and
        # command injection rely on servers that accept bare LF here).
        while True:
            try:
                line = await read(b"\n")
            except asyncio.LimitOverrunError as e:
                return await self._discard_long_line(read, e.consumed)
            if _clean_command(line):
                return line
            self._bogus += 1
            if self.transport is None:
                await self._until_cancelled()
            if self._bogus >= _MAX_BOGUS_COMMANDS:
                self.hang_up(replies.BARE_NEWLINE_COMMAND)
                await self._until_cancelled()
            self._writer.write(f"{replies.BARE_NEWLINE_COMMAND}\r\n".encode())

    async def _discard_long_line(self, read: _READ, consumed: int) -> bytes:
        """Drop an over-long command line as it arrives; return a stand-in that aiosmtpd
        refuses as too long. aiosmtpd would otherwise split the line's CR from its LF,
        answering a bare LF that the client never sent."""
        await self._reader.read(consumed)
        while True:
            try:
                await read(b"\n")
                break
            except asyncio.LimitOverrunError as e:
                await self._reader.read(e.consumed)
        return b"TOOLONG " + b"x" * self.command_size_limit + b"\r\n"

    async def smtp_DATA(self, arg: str) -> None:
        """aiosmtpd's DATA command with its checks and replies, but the transfer is read in
        chunks up to each ".\r\n" instead of one await per line: per message, aiosmtpd's
        line loop cost more than smtpguard's whole policy."""
        if await self.check_helo_needed():
            return
        if await self.check_auth_needed("DATA"):
            return
        assert self.envelope is not None and not self._decode_data
        if not self.envelope.rcpt_tos:
            await self.push("503 Error: need RCPT command")
            return
        if arg:
            await self.push("501 Syntax: DATA")
            return
        await self.push("354 End data with <CR><LF>.<CR><LF>")
        try:
            received = await self._receive_data()
        except asyncio.CancelledError:
            log.info("connection lost during DATA", extra=self._where())
            self._writer.close()
            raise
        finally:
            self._stop_data_timer()
        if isinstance(received, Reply):
            await self.push(str(received))
            self._set_post_data_state()
            return
        self.envelope.content = self.envelope.original_content = received
        status = await self._call_handler_hook("DATA")
        self._set_post_data_state()
        await self.push("250 OK" if status is MISSING else status)

    async def _receive_data(self) -> bytes | Reply:
        """Read up to the end-of-data line and undo dot-stuffing (RFC 5321 4.5.2).

        The end is exactly CRLF "." CRLF (or "." CRLF first): a bare LF or CR around the dot
        is data, which smuggling_check then refuses. Past max_message_size the data is
        dropped as it arrives, keeping only the bytes the end test needs; the reply waits
        for the end of the transfer (RFC 5321 4.2.5)."""
        self._data_timer = self.loop.call_later(self._data_timeout, self._data_timed_out)
        read = self._read_raw
        size_limit = self.data_size_limit
        line_limit = self.line_length_limit
        stream = bytearray()
        refusal: Reply | None = None
        while True:
            try:
                chunk = await read(b".\r\n")
            except asyncio.LimitOverrunError as e:
                # No ".\r\n" within the reader's limit: take what cannot hold its start.
                chunk = await self._reader.read(e.consumed)
            before = len(stream)
            stream += chunk
            if chunk.endswith(b".\r\n") and (stream.endswith(b"\r\n.\r\n") or stream == b".\r\n"):
                break
            if refusal is not None:
                # Refused already: drop the data as it arrives, keep what the end test needs.
                del stream[:-4]
                continue
            # Only the line still open at `before` and the new ones can have grown too long.
            line_start = stream.rfind(b"\n", max(0, before - line_limit), before) + 1
            if self._long_line.search(stream, line_start or max(0, before - line_limit)):
                refusal = replies.LINE_TOO_LONG
            elif size_limit and len(stream) > size_limit:
                refusal = replies.SIZE_EXCEEDED
        if refusal is None:
            del stream[-3:]
            if size_limit and len(stream) > size_limit:
                refusal = replies.SIZE_EXCEEDED
            elif self._long_line.search(stream, max(0, before - line_limit)):
                refusal = replies.LINE_TOO_LONG
        if refusal is not None:
            return refusal
        if stream.startswith(b"."):
            del stream[0]
        return bytes(stream.replace(b"\r\n.", b"\r\n"))

    def data_received(self, data: bytes) -> None:
        # Progress is a line, not a byte: a client trickling bytes (slowloris) stays idle.
        if b"\n" in data:
            self._last_data = self.loop.time()
        super().data_received(data)

    async def _until_cancelled(self) -> None:
        """Wait for connection_lost to cancel this session's task (after a hang-up)."""
        await self.loop.create_future()

    def _data_timed_out(self) -> None:
        self._data_timer = None
        log.info("DATA transfer exceeded data_timeout", extra=self._where())
        self.hang_up(replies.DATA_TIMEOUT)

    def _timeout_cb(self) -> None:
        # Idle means "sends nothing", not "has not finished": during DATA each line keeps the
        # session alive (data_timeout caps the whole transfer). Checked here, when the timer
        # fires, so nothing is re-armed per chunk received.
        if self._data_timer is not None:
            quiet = self.loop.time() - self._last_data
            if quiet < self._timeout_duration:
                self._reset_timeout(self._timeout_duration - quiet)
                return
        log.info("idle timeout", extra=self._where())
        self.hang_up(replies.IDLE_TIMEOUT)

    def _stop_data_timer(self) -> None:
        if self._data_timer is not None:
            self._data_timer.cancel()
            self._data_timer = None

    def _set_post_data_state(self) -> None:
        self._stop_data_timer()
        super()._set_post_data_state()  # type: ignore[no-untyped-call]

    async def _call_handler_hook(self, command: str, *args: Any) -> Any:
        if command != "DATA":
            return await super()._call_handler_hook(command, *args)
        # The message is in: from here the client waits on smtpguard and its provider, so
        # neither the DATA cap nor the idle timer may cut the submission short.
        self._stop_data_timer()
        async with self.working():
            return await super()._call_handler_hook(command, *args)

    @contextlib.asynccontextmanager
    async def working(self) -> AsyncIterator[None]:
        """While smtpguard works and the client waits (password check, relay), the client is
        not idle: the idle timer stops, and restarts when the reply is due."""
        if self._timeout_handle is not None:
            self._timeout_handle.cancel()
        try:
            yield
        finally:
            if self.transport is not None:
                self._reset_timeout()

    def hang_up(self, reply: Reply) -> None:
        """Send a last reply and close; abort if the client will not take the reply."""
        # Not an isinstance test: uvloop's transports do not derive from asyncio's classes.
        transport = cast(asyncio.Transport | None, self.transport)
        if transport is None or transport.is_closing():
            return
        transport.write(f"{reply}\r\n".encode())
        transport.close()
        self._abort_timer = self.loop.call_later(_HANG_UP_GRACE, transport.abort)

    def _getaddr(self, arg: str) -> tuple[str | None, str | None]:
        """Judge the address the client wrote, not the one aiosmtpd's parser made of it: the
        parser drops source routes (`<@relay:user@dom>`), comments and quoting, and gives up
        on `user@a@b`; any of those, written by a client, is refused as written (501)."""
        raw, raw_rest = _raw_path(arg)
        if raw and arg.lstrip().startswith("<") and address_problem(raw) is None:
            # The plain `<local@domain>` every client writes: nothing for the RFC 5322
            # parser to find (no quotes, routes, comments), so skip its cost.
            return raw, raw_rest
        address, rest = super()._getaddr(arg)
        if address is None:
            if raw and address_problem(raw):
                return raw, raw_rest
            return None, None
        if raw != address:
            return raw, rest
        return address, rest

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is None and self._admitted_ip is None:
            transport = cast(asyncio.Transport, transport)
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
        self._stop_data_timer()
        if self._abort_timer is not None:
            self._abort_timer.cancel()
            self._abort_timer = None
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
        # aiosmtpd's answer to EOF is to cancel the session task, whose cancellation path
        # closes the transport. A peer that closes at once (a TCP health check) can have its
        # EOF read in the same loop turn as the accept (uvloop does), cancelling the task
        # before its first step: nothing would then close the transport, and the connection
        # would stay open and counted against max_connections for good.
        task = self._handler_coroutine
        if task is not None:
            task.add_done_callback(self._close_after_eof)
        return result

    def _close_after_eof(self, _task: asyncio.Task[None]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    async def push(self, status: AnyStr) -> None:
        text = status.decode() if isinstance(status, bytes) else status
        rewrite = replies.AIOSMTPD_REWRITES.get(text)
        if rewrite is None:
            rewrite = next((r for p, r in replies.AIOSMTPD_PREFIX_REWRITES if text.startswith(p)), None)
        await super().push(str(rewrite) if rewrite else text)


def _raw_path(arg: str) -> tuple[str, str]:
    """The path of a MAIL/RCPT argument as written, and the parameters after it."""
    arg = arg.strip()
    if arg.startswith("<"):
        path, _, rest = arg[1:].partition(">")
        return path, rest.strip()
    path, _, rest = arg.partition(" ")
    return path, rest.strip()


@functools.cache
def _long_line_pattern(limit: int) -> re.Pattern[bytes]:
    """A DATA line longer than `limit` octets with its CRLF, not counting a leading dot
    (RFC 5321 4.5.3.1.6: the dot a client adds for transparency is not part of the line;
    possessive, so it is never counted back in). Anchored at line starts by the lookbehind,
    so the search is linear in the message."""
    return re.compile(rb"(?<![^\n])\.?+[^\r\n]{%d}" % (limit - 1))


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
        recipient_domains: RecipientDomains | None = None,
        observe: Callable[[str], None] | None = None,
    ) -> None:
        self.submitter = submitter
        self.recipient_domains = recipient_domains
        """The RCPT domain check of zones with `recipient_domains: check` (DESIGN.md §12)."""
        self.store = store
        self.verifier = verifier
        self.connections = Connections()
        self.on_result = on_result
        self.clock = clock
        self.observe = observe or (lambda event: None)
        """Events for metrics: auth_failure, auth_lockout, store_error:<where>."""
        self.active = 0
        """Submissions between end of DATA and their reply (graceful stop waits for them)."""
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = False
        self._submissions: set[asyncio.Task[str]] = set()
        self._auth_turns = Turns()

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
            blob = await _challenge(server, "")
        else:
            blob = await _initial_response(server, args[1])
        if blob is None:
            return AuthResult(success=False, handled=True)
        parts = blob.split(b"\x00")
        if len(parts) != 3:
            await server.push(str(replies.AUTH_BAD_PLAIN))
            return AuthResult(success=False, handled=True)
        return await self._authenticate(server, parts[1], parts[2])

    async def auth_LOGIN(self, server: SMTP, args: list[str]) -> AuthResult:
        if len(args) == 1:
            login = await _challenge(server, "Username:")
        else:
            login = await _initial_response(server, args[1])
        if login is None:
            return AuthResult(success=False, handled=True)
        password = await _challenge(server, "Password:")
        if password is None:
            return AuthResult(success=False, handled=True)
        return await self._authenticate(server, login, password)

    async def _authenticate(self, server: SMTP, login: bytes, password: bytes) -> AuthResult:
        ip = _peer_ip(server.session)
        # One verification at a time per client IP: N parallel connections must not each
        # pass the failure check before any of them has recorded its failure.
        async with self._auth_turns.turn(ip):
            if isinstance(server, GuardSMTP):
                async with server.working():
                    return await self._authenticate_one(server, ip, login, password)
            return await self._authenticate_one(server, ip, login, password)

    async def _authenticate_one(self, server: SMTP, ip: str, login: bytes, password: bytes) -> AuthResult:
        limits = self.config.limits
        try:
            if (
                await self.store.auth_failures(ip, self.clock(), limits.auth_failure_window)
                >= limits.auth_failures
            ):
                return await self._lock_out(server, ip)
            username = login.decode("utf-8", "replace")
            found = self.config.user_zone(username)
            try:
                secret: str | None = password.decode("utf-8")
            except UnicodeDecodeError:
                # No hash-password output can match bytes that are not UTF-8; still pay the
                # full verification so the reply time says nothing.
                secret = None
            ok = await self.verifier.verify_any(
                username,
                found[1].hashes if found and secret is not None else (),
                secret or "",
                pad_to=_most_hashes(self.config),
            )
            if ok and found and secret is not None:
                principal = Principal(found[0], username, ip, _session_id(server.session))
                return AuthResult(success=True, auth_data=principal)
            failures = await self.store.auth_failure(ip, self.clock(), limits.auth_failure_window)
        except StoreUnavailable:
            self.observe("store_error:auth")
            return AuthResult(success=False, handled=False, message=str(replies.STORE_UNAVAILABLE))
        self.observe("auth_failure")
        log.info(
            "authentication failed",
            extra={"client_ip": ip, "session": _session_id(server.session), "failures": failures},
        )
        if failures >= limits.auth_failures:
            return await self._lock_out(server, ip)
        return AuthResult(success=False, handled=False, message=str(replies.AUTH_INVALID))

    async def _lock_out(self, server: SMTP, ip: str) -> AuthResult:
        self.observe("auth_lockout")
        log.warning("AUTH locked out", extra={"client_ip": ip, "session": _session_id(server.session)})
        if isinstance(server, GuardSMTP):
            server.hang_up(replies.AUTH_LOCKED)
        else:
            await server.push(str(replies.AUTH_LOCKED))
            if server.transport is not None:
                server.transport.close()
        return AuthResult(success=False, handled=True)

    async def handle_exception(self, error: Exception) -> str:
        """aiosmtpd's fallback would log a traceback and echo the exception text to the
        client; only a real bug deserves the first, and nobody the second."""
        if isinstance(error, TLSSetupException):
            # aiosmtpd closes the connection without sending this.
            log.info("TLS handshake failed", extra={"error": type(error.__cause__).__name__})
            return str(replies.TLS_FAILED)
        log.error("unexpected error in an SMTP session", exc_info=error)
        return str(replies.INTERNAL_ERROR)

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
        # aiosmtpd has moved SMTPUTF8 from the parameters to envelope.smtp_utf8 already.
        # Judged before the syntax: without it a non-ASCII address is not SMTP syntax at all.
        unsendable = smtputf8_refusal(
            address, "sender", envelope.smtp_utf8, self._route_smtputf8(principal.zone)
        )
        if unsendable:
            return self._refuse(principal, unsendable)
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
        # Each recipient on its own: those accepted before stay accepted (RFC 6531).
        unsendable = smtputf8_refusal(
            address, "recipient", envelope.smtp_utf8, self._route_smtputf8(principal.zone)
        )
        if unsendable:
            return self._refuse(principal, unsendable)
        problem = address_problem(address)
        if problem:
            return self._refuse(principal, replies.bad_address("recipient", problem))
        try:
            listed = await self.submitter.suppressions.find(principal.zone, address)
        except StoreUnavailable:
            self.observe("store_error:rcpt")
            return str(replies.STORE_UNAVAILABLE)
        if listed:
            return self._refuse(principal, replies.suppressed(address, listed))
        zone = self.config.zones.get(principal.zone)
        if zone is not None and zone.recipient_domains == "check" and self.recipient_domains is not None:
            unroutable = await self.recipient_domains.refusal(address)
            if unroutable is not None:
                return self._refuse(principal, unroutable)
        envelope.rcpt_tos.append(normalize_address(address))
        envelope.rcpt_options.extend(rcpt_options)
        return str(replies.OK_RECIPIENT)

    def _route_smtputf8(self, zone: str) -> bool | None:
        """What the last EHLOs of the zone's route (its own `providers`, else the top-level
        one) said about SMTPUTF8 (read per command: a reload replaces the route, and a
        relay may just have learnt a provider's answer)."""
        return route_offers_smtputf8(p.smtputf8 for p in self.submitter.route.providers_for(zone))

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
        self.active += 1
        self.idle.clear()
        task = asyncio.create_task(
            self._submit(
                principal,
                envelope.mail_from,
                list(envelope.rcpt_tos),
                envelope.original_content or b"",
                bool(envelope.smtp_utf8),
            )
        )
        self._submissions.add(task)
        task.add_done_callback(self._submissions.discard)
        # A client that hangs up after its final dot must not abandon a relay half done: the
        # submission runs to its recorded outcome, whoever is left to hear the reply.
        reply = await asyncio.shield(task)
        return reply

    async def _submit(
        self, principal: Principal, mail_from: str, rcpt_tos: list[str], raw: bytes, smtputf8: bool
    ) -> str:
        started = time.perf_counter()
        try:
            result = await self.submitter.submit(principal, mail_from, rcpt_tos, raw, smtputf8)
        except Exception:
            log.exception(
                "internal error while handling a submission",
                extra={
                    "zone": principal.zone,
                    "client_ip": principal.client_ip,
                    "session": principal.session,
                },
            )
            result = Result(replies.INTERNAL_ERROR, "internal_error")
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()
        self.on_result(principal, result, time.perf_counter() - started)
        return str(result.reply)


async def _challenge(server: SMTP, prompt: str) -> bytes | None:
    """One AUTH challenge; None when the client aborted or sent no usable answer (replied).
    An over-long answer reaches challenge_auth as GuardSMTP's stand-in line: not base64."""
    blob = await server.challenge_auth(prompt)
    return blob if isinstance(blob, bytes) else None


async def _initial_response(server: SMTP, arg: str) -> bytes | None:
    try:
        return base64.b64decode(arg.encode(), validate=True)
    except (binascii.Error, ValueError):
        await server.push(str(replies.AUTH_BAD_BASE64))
        return None


def _session_id(session: Session | None) -> str | None:
    sid = getattr(session, "id", None)
    return sid if isinstance(sid, str) else None


def _peer_ip(session: Session | None) -> str:
    peer = getattr(session, "peer", None)
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "?"


def _most_hashes(config: Config) -> int:
    """The most password hashes any user holds (2 during a rotation): every failed AUTH
    costs that many verifications, so its time does not tell which usernames exist."""
    return max((len(u.hashes) for z in config.zones.values() for u in z.users), default=1)
