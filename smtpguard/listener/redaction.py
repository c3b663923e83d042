"""aiosmtpd's log of client lines, with credentials masked before any handler sees a record."""

from __future__ import annotations

import logging

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
