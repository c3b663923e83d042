"""An upstream session past its greeting: MAIL, RCPT, DATA, RSET and QUIT on the transport
aiosmtplib connected, (STARTTLS-)upgraded, greeted and authenticated (DESIGN.md §6).

aiosmtplib stays in charge of everything before MAIL (connect, TLS, EHLO, AUTH and their
errors). The transaction itself is written here because aiosmtplib's protocol keeps a single
reply waiter and drops what arrives while it is filled, so it cannot have two replies in
flight (RFC 2920 PIPELINING), and because its per-command layers (a command lock, an
`asyncio.wait_for` per reply, two regex passes over the message) cost more CPU than the
round trips. Failures are raised as aiosmtplib's own exception types, with its texts, so
relay/smtp.py translates them in one place whichever side raised them.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from functools import lru_cache
from typing import cast

import aiosmtplib
from aiosmtplib.email import quote_address

MAX_LINE = 8192
MAX_REPLY = MAX_LINE * 4
"""A whole reply, continuations included, may not exceed this (aiosmtplib's bounds)."""
_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")
_LINE_ENDINGS = re.compile(rb"\r\n|\n|\r(?!\n)")
_LEADING_DOT = re.compile(rb"(?m)^\.")
_AFTER_CODE = (b" ", b"-", b"\r", b"\n")

Answer = tuple[int, str]


@lru_cache(maxsize=4096)
def _quoted(address: str) -> str:
    # Senders and recipients repeat from message to message; the quoting (email.utils'
    # parser and aiosmtplib's injection checks) is pure, and raises for what it refuses.
    return quote_address(address)


def command(verb: bytes, address: str, encoding: str, options: bytes = b"") -> bytes:
    """`MAIL FROM:<a>` / `RCPT TO:<a>` as written on the wire. Raises ValueError for an
    address aiosmtplib would refuse to write and UnicodeEncodeError for one `encoding`
    cannot carry, before anything is sent."""
    arg = _quoted(address).encode(encoding)
    if _CONTROL.search(arg):
        raise ValueError("Command arg contains a prohibited control character")
    return verb + arg + options + b"\r\n"


def data_block(message: bytes) -> bytes:
    """The message as sent after the 354 (RFC 5321 §4.5.2): CRLF line endings, a final
    CRLF, leading dots doubled, then the final dot. What aiosmtplib sends, but the common
    message (CRLF already, no line opening with a dot) is only scanned, not rewritten."""
    lf = message.count(b"\n")
    if message.count(b"\r\n") != lf or message.count(b"\r") != lf:
        message = _LINE_ENDINGS.sub(b"\r\n", message)
    if not message.endswith(b"\r\n"):
        message += b"\r\n"
    if message.startswith(b".") or b"\n." in message:
        message = _LEADING_DOT.sub(b"..", message)
    return message + b".\r\n"


class Session(asyncio.Protocol):
    """One authenticated upstream connection. Replies are paired with the commands awaiting
    them in the order the commands were written; bytes nobody is waiting for are dropped,
    never kept for the next command (a reply must not be mistaken for a later one's)."""

    def __init__(
        self, transport: asyncio.Transport, *, pipelining: bool, smtputf8: bool, eightbitmime: bool = False
    ) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._buffer = bytearray()
        self._waiting: deque[asyncio.Future[Answer]] = deque()
        self._closed = False
        self.pipelining = pipelining
        self.smtputf8 = smtputf8
        self.eightbitmime = eightbitmime
        """The EHLO offered 8BITMIME (RFC 6152): a message with octets above 127 may be sent."""

    @classmethod
    def take_over(cls, conn: aiosmtplib.SMTP) -> Session:
        """The transport of `conn`, greeted and authenticated, from now on read here.
        aiosmtplib's object is left behind without closing what it no longer owns."""
        if conn.transport is None or conn.transport.is_closing():
            raise aiosmtplib.SMTPServerDisconnected("Connection lost")
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        transport = cast(asyncio.Transport, conn.transport)
        session = cls(
            transport,
            pipelining=conn.supports_extension("pipelining"),
            smtputf8=conn.supports_extension("smtputf8"),
            eightbitmime=conn.supports_extension("8bitmime"),
        )
        transport.set_protocol(session)
        conn.transport = None
        conn.protocol = None
        return session

    @property
    def is_connected(self) -> bool:
        return not self._closed and not self._transport.is_closing()

    # --- commands ------------------------------------------------------------------------
    def send(self, data: bytes, replies: int = 1) -> list[asyncio.Future[Answer]]:
        """Write `data` (one command, or a PIPELINING group of `replies` commands, or the
        message) in one write; the futures of its replies, in order."""
        if not self.is_connected:
            raise aiosmtplib.SMTPServerDisconnected("Connection lost")
        futures = [self._loop.create_future() for _ in range(replies)]
        self._waiting.extend(futures)
        self._transport.write(data)
        return futures

    async def reply(self, future: asyncio.Future[Answer], timeout: float) -> Answer:
        """A reply written for, within `timeout` seconds of asking. A reply given up on
        leaves the session out of step: it is closed."""
        timer = self._loop.call_later(timeout, self._expire, future)
        try:
            return await future
        finally:
            timer.cancel()

    async def command(self, data: bytes, timeout: float) -> Answer:
        return await self.reply(self.send(data)[0], timeout)

    async def quit(self) -> None:
        try:
            await self.command(b"QUIT\r\n", 2)
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.close()
        self._fail(aiosmtplib.SMTPServerDisconnected("Connection lost"))

    def _expire(self, future: asyncio.Future[Answer]) -> None:
        if not future.done():
            future.set_exception(aiosmtplib.SMTPReadTimeoutError("Timed out waiting for server response"))
            future.exception()
        self.close()

    def _fail(self, exc: Exception) -> None:
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(exc)
                # Marked retrieved: a reply never awaited (its session closed first) must
                # not be logged as "exception was never retrieved".
                future.exception()
        self._buffer.clear()

    # --- asyncio.Protocol ----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if not self._waiting:
            return
        buffer = self._buffer
        buffer += data
        while self._waiting:
            try:
                answer = _parse(buffer)
                # The bound is on the reply still incomplete, not on the read: one read may
                # carry the short replies to hundreds of pipelined RCPTs.
                if answer is None and len(buffer) > MAX_REPLY:
                    raise aiosmtplib.SMTPResponseException(-1, "Response too long")
            except aiosmtplib.SMTPResponseException as e:
                self._fail(e)
                self.close()
                return
            if answer is None:
                return
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(answer)
        buffer.clear()

    def eof_received(self) -> bool:
        self._fail(aiosmtplib.SMTPServerDisconnected("Unexpected EOF received"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        lost = aiosmtplib.SMTPServerDisconnected("Connection lost")
        lost.__cause__ = exc
        self._fail(lost)


def _parse(buffer: bytearray) -> Answer | None:
    """The first complete reply in `buffer`, removed from it; None if it is incomplete."""
    offset = 0
    first = 0
    lines: list[bytes] = []
    while True:
        end = buffer.find(b"\n", offset)
        if end == -1:
            return None
        line = bytes(buffer[offset : end + 1])
        if len(line) > MAX_LINE:
            raise aiosmtplib.SMTPResponseException(-1, "Response too long")
        # Three digits, 2 to 5 first, then a space, a hyphen or the line's end (RFC 5321
        # §4.2): int() alone would read "25 ok" as 25 and "2_50" as 250.
        head = line[:3]
        if not (head.isdigit() and b"2" <= head[:1] <= b"5" and line[3:4] in _AFTER_CODE):
            text = line.decode("utf-8", errors="ignore")
            raise aiosmtplib.SMTPResponseException(-1, f"Malformed SMTP response line: {text}")
        code = int(head)
        if lines and code != first:
            # RFC 5321 §4.2.1: every line of one reply carries the same code. `250-queued
            # as A1` then `451 try later` says both; read as its last line it would defer
            # (and so resend) a message the provider may have queued. No outcome at all:
            # before the dot unavailable, after it unknown (relay/smtp.py).
            raise aiosmtplib.SMTPResponseException(
                -1, f"Malformed SMTP response: one reply with codes {first} and {code}"
            )
        first = code
        lines.append(line[4:].strip(b" \t\r\n"))
        offset = end + 1
        if line[3:4] != b"-":
            del buffer[:offset]
            return code, b"\n".join(lines).decode("utf-8", "surrogateescape")
