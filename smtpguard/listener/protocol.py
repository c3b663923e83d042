"""GuardSMTP: aiosmtpd's SMTP protocol narrowed where smtpguard's contract is stricter.

aiosmtpd ≥ 1.4.6 is the SMTP engine; GuardSMTP narrows it: connection limits, bare LF in
commands, envelope addresses judged as sent, line length, idle and DATA timeouts, enhanced
codes on aiosmtpd's own replies. It asks its handler (handler.py) only what `Guard` names.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, AnyStr, NoReturn, Protocol, cast

from aiosmtpd.smtp import MISSING, Session, syntax

from smtpguard import replies
from smtpguard.config import Config
from smtpguard.policy.senders import address_problem
from smtpguard.replies import Reply
from smtpguard.smtp_session import LimitedSession

log = logging.getLogger("smtpguard.listener")
_MAX_BOGUS_COMMANDS = 10
_READ = Callable[[bytes], Awaitable[bytes]]


class Guard(Protocol):
    """What GuardSMTP needs of its handler: the limits, and admission of a connection."""

    @property
    def config(self) -> Config: ...

    def admit(self, ip: str) -> bool: ...

    def release(self, ip: str) -> None: ...


class GuardSession(Session):
    """aiosmtpd's session with an id that every log line about the connection carries."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.id = secrets.token_hex(6)


class GuardSMTP(LimitedSession):
    log = log

    def __init__(self, handler: Guard, **kwargs: Any) -> None:
        limits = handler.config.limits
        # aiosmtpd sizes its StreamReader from this attribute in SMTP.__init__: it bounds every
        # command and DATA line, and with it the memory one line can take.
        self.line_length_limit = limits.max_line_length
        self._data_timeout = limits.data_timeout
        self._long_line = _long_line_pattern(limits.max_line_length)
        self._data_timer: asyncio.TimerHandle | None = None
        self._last_data = 0.0
        super().__init__(
            handler, max_errors=limits.max_errors, max_junk_commands=limits.max_junk_commands, **kwargs
        )
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
                try:
                    line = await read(b"\n")
                except asyncio.LimitOverrunError as e:
                    return await self._discard_long_line(read, e.consumed)
            except asyncio.IncompleteReadError:
                # The client's half-close (eof_received), with every whole command before
                # it answered: the session ends here; a command cut short is not run.
                await self._end_at_eof()
            if _clean_command(line):
                return line
            self._bogus += 1
            if self.transport is None:
                await self._until_cancelled()
            if self._bogus >= _MAX_BOGUS_COMMANDS:
                self.hang_up(replies.BARE_NEWLINE_COMMAND)
                await self._until_cancelled()
            self._writer.write(f"{replies.BARE_NEWLINE_COMMAND}\r\n".encode())

    async def _end_at_eof(self) -> NoReturn:
        """Close after the client's EOF, once the replies written so far have gone out, and
        wait for connection_lost to cancel this session's task."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        await self._until_cancelled()
        raise AssertionError("not reached: connection_lost cancels the session")

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

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        """aiosmtpd's MAIL, but the null reverse-path reaches the handler, and RFC 4954's
        AUTH parameter is taken and ignored (_without_auth_parameter). `<>` is SMTP
        syntax (RFC 5321 §4.1.2), which aiosmtpd answers with its 501 "Syntax" itself; it
        names no sender, so no zone maps it: the handler's sender check refuses it (550
        5.7.1, DESIGN.md §3) whatever its parameters say."""
        arg = _without_auth_parameter(arg)
        path = self._strip_command_keyword("FROM:", arg) if arg is not None else None
        if path is None or not path.startswith("<>"):
            await super().smtp_MAIL(arg)
            return
        if await self.check_helo_needed() or await self.check_auth_needed("MAIL"):
            return
        assert self.envelope is not None
        if self.envelope.mail_from:
            await self.push("503 Error: nested MAIL command")
            return
        status = await self._call_handler_hook("MAIL", "", [])
        await self.push(str(replies.MAIL_SYNTAX) if status is MISSING else status)

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
        except asyncio.IncompleteReadError:
            # Half-closed before the end of data: the message is not whole; nothing taken.
            log.info("connection lost during DATA", extra=self._where())
            await self._end_at_eof()
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
        for the end of the transfer (RFC 5321 4.2.5). The size is the message's, without
        the dots of dot-stuffing (RFC 1870 §4): a message that fits its declared SIZE=
        is not refused for the dots its transfer adds."""
        self._data_timer = self.loop.call_later(self._data_timeout, self._data_timed_out)
        read = self._read_raw
        size_limit = self.data_size_limit
        line_limit = self.line_length_limit
        stream = bytearray()
        stuffed = 0
        """Lines of `stream` that open with a dot: each carries one the message has not."""
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
            # A dot opening a line after CRLF, counted once: a match that starts before
            # `before - 2` was whole, and counted, in the stream before this chunk.
            stuffed += stream.count(b"\r\n.", max(0, before - 2))
            # Only the line still open at `before` and the new ones can have grown too long.
            line_start = stream.rfind(b"\n", max(0, before - line_limit), before) + 1
            if self._long_line.search(stream, line_start or max(0, before - line_limit)):
                refusal = replies.LINE_TOO_LONG
            elif size_limit and len(stream) - stuffed - stream.startswith(b".") > size_limit:
                refusal = replies.SIZE_EXCEEDED
        if refusal is None:
            del stream[-3:]
            size = len(stream) - stream.count(b"\r\n.") - stream.startswith(b".")
            if size_limit and size > size_limit:
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
        if self._refused:
            return
        if self._admitted_ip is not None:
            self._guard.release(self._admitted_ip)
            self._admitted_ip = None
        super().connection_lost(error)

    def eof_received(self) -> bool | None:
        if self._refused:
            return None
        if self.session is not None and self.session.ssl is None and not self._over_tls():
            # A half-close (FIN) over plain TCP: "nothing more from me", not "forget what I
            # sent". Commands already received are read and answered as Postfix does (a
            # pipelined transaction sent by `printf … | nc -N` gets its replies), and
            # the reader's EOF then ends the session (_end_at_eof). aiosmtpd's own answer,
            # cancelling the session at once, would drop them unanswered. TLS has no
            # half-close: there the connection ends now, as before.
            return asyncio.StreamReaderProtocol.eof_received(self)
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

    def _over_tls(self) -> bool:
        return self.transport is not None and self.transport.get_extra_info("sslcontext") is not None

    def _close_after_eof(self, _task: asyncio.Task[None]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    async def push(self, status: AnyStr) -> None:
        text = status.decode() if isinstance(status, bytes) else status
        rewrite = replies.AIOSMTPD_REWRITES.get(text)
        if rewrite is None:
            rewrite = next((r for p, r in replies.AIOSMTPD_PREFIX_REWRITES if text.startswith(p)), None)
        await super().push(str(rewrite) if rewrite else text)


def _without_auth_parameter(arg: str | None) -> str | None:
    """MAIL's argument without its `AUTH=<mailbox>` parameter (RFC 4954 §5), which an MTA
    such as sendmail sends to a smarthost that offers AUTH. It is part of the extension the
    EHLO advertises, so not "unrecognized" (aiosmtpd's 555); smtpguard does not trust the
    identity it names, which §5 has a server treat as `AUTH=<>`: it changes nothing, and it
    is dropped here. An empty `AUTH=` is left for aiosmtpd to refuse as bad syntax."""
    if arg is None or "AUTH=" not in arg.upper() or arg[:5].upper() != "FROM:":
        return arg
    path, rest = _raw_path(arg[5:])
    tokens = rest.split()
    kept = [t for t in tokens if not (t[:5].upper() == "AUTH=" and len(t) > 5)]
    if len(kept) == len(tokens):
        return arg
    head = f"<{path}>" if arg[5:].lstrip().startswith("<") else path
    return " ".join([f"FROM:{head}", *kept])


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
