"""An aiosmtpd session held to Postfix's hard error and junk command limits.

A client that only errs (refused commands, commands out of order) or only idles in place
(NOOP, RSET, VRFY, EXPN, HELP, a greeting again) each few seconds would hold its connection
for good: every command resets the idle timer. Since the session last had a message
accepted, `max_errors` error replies end it, and each junk command past `max_junk_commands`
counts as an error (smtpd_hard_error_limit, smtpd_junk_command_limit); a delivery starts both
counts afresh, so a long session of many messages is never cut. The SMTP submission listener
(listener/protocol.py, from `limits`) and the events mailbox (Postfix's defaults) share it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, AnyStr, cast

from aiosmtpd.smtp import SMTP

from smtpguard import replies
from smtpguard.replies import Reply

MAX_ERRORS = 20
MAX_JUNK_COMMANDS = 100
_JUNK_COMMANDS = ("NOOP", "RSET", "VRFY", "EXPN", "HELP")
"""Postfix's junk commands (it has ETRN where aiosmtpd has EXPN and HELP): harmless one by
one, and each one resets the idle timer."""
_GREETINGS = ("HELO", "EHLO")
"""Junk too when the session has greeted already: a client greets once, and once more after
STARTTLS (a new session, RFC 3207 4.2); repeated, they would hold a connection as NOOP did."""
_TRANSACTION = ("MAIL", "RCPT", "DATA")
_ENDED = "421 4.7.0 Session ended"
"""A stand-in answer of a hook after hang_up; never written (push writes nothing then)."""
_HANG_UP_GRACE = 5.0
"""Seconds a closing connection may take to flush its last reply before it is aborted (a
client that never reads must not keep the socket open)."""


class LimitedSession(SMTP):
    log = logging.getLogger("smtpguard.smtp")
    recipient_refusals_count = False
    """Whether the handler's refusal of a recipient is an error. Not where only a signed-in
    client reaches the handler's RCPT (the submission listener): its list with 20 refused
    recipients is a message for the others. Where strangers do (the events mailbox), yes,
    or RCPT after RCPT would hold the connection."""

    def __init__(
        self,
        handler: Any,
        *,
        max_errors: int = MAX_ERRORS,
        max_junk_commands: int = MAX_JUNK_COMMANDS,
        **kwargs: Any,
    ) -> None:
        self._max_errors = max_errors
        self._max_junk = max_junk_commands
        self._errors = 0
        self._junk = 0
        self._recipient_answer = False
        self._abort_timer: asyncio.TimerHandle | None = None
        super().__init__(handler, **kwargs)
        for name in _JUNK_COMMANDS + _GREETINGS:
            self._smtp_methods[name] = self._counted_as_junk(name, self._smtp_methods[name])

    def _where(self) -> dict[str, object]:
        """The fields that place a log line about this connection."""
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return {"client_ip": str(peer[0]) if peer else "?"}

    def _closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    async def _call_handler_hook(self, command: str, *args: Any) -> Any:
        if command in _TRANSACTION and self._closing():
            # Ended (hang_up) with commands still buffered behind the last reply: aiosmtpd
            # goes on reading them, but none of them reaches the handler (no message is
            # taken after the session was told 421). push sends nothing now.
            return _ENDED
        if command == "RCPT" and not self.recipient_refusals_count:
            # The handler's answer about one recipient (suppressed, held, past
            # max_recipients) is no error of the client's: RFC 5321 has it send DATA for
            # those accepted, so it is not counted (push).
            self._recipient_answer = True
        status = await super()._call_handler_hook(command, *args)
        if command == "DATA" and isinstance(status, str) and status.startswith("250"):
            # A client that delivers is not probing: its errors and junk start afresh.
            self._errors = self._junk = 0
        return status

    def _counted_as_junk(
        self, name: str, method: Callable[[str], Awaitable[None]]
    ) -> Callable[[str], Awaitable[None]]:
        """aiosmtpd's command, then counted as junk (a greeting only when the session has
        one). functools.wraps keeps the syntax that aiosmtpd's HELP reads from the method."""

        @functools.wraps(method)
        async def junk(arg: str) -> None:
            counted = name not in _GREETINGS or getattr(self.session, "host_name", None) is not None
            await method(arg)
            if counted:
                self._junk += 1
                if self._junk > self._max_junk:
                    self._error()

        return junk

    def _error(self) -> None:
        """One more error in this session; at `max_errors` the session ends."""
        if self._closing():
            return
        self._errors += 1
        if self._errors >= self._max_errors:
            self.log.warning(
                "too many errors; session closed", extra={**self._where(), "errors": self._errors}
            )
            self.hang_up(replies.TOO_MANY_ERRORS)

    def hang_up(self, reply: Reply) -> None:
        """Send a last reply and close; abort if the client will not take the reply."""
        # Not an isinstance test: uvloop's transports do not derive from asyncio's classes.
        transport = cast(asyncio.Transport | None, self.transport)
        if transport is None or transport.is_closing():
            return
        transport.write(f"{reply}\r\n".encode())
        transport.close()
        self._abort_timer = self.loop.call_later(_HANG_UP_GRACE, transport.abort)

    def connection_lost(self, error: Exception | None) -> None:
        if self._abort_timer is not None:
            self._abort_timer.cancel()
            self._abort_timer = None
        super().connection_lost(error)

    async def push(self, status: AnyStr) -> None:
        counted = not self._recipient_answer
        self._recipient_answer = False
        if self._closing():
            # hang_up has written the last reply: aiosmtpd's own push of a hook's answer
            # would still be flushed before the close, a second reply to one command.
            return
        await super().push(status)
        text = status.decode() if isinstance(status, bytes) else status
        if counted and text[:1] in ("4", "5") and text[1:3].isdigit():
            self._error()
