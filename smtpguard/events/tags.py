"""The header that makes a provider echo the event key back in its webhooks (§13).

Each provider carries custom data its own way; smtpguard adds the zone-qualified key as
that provider's custom variable, so an event finds its record even when the provider
rewrites the Message-ID. Pure: bytes in, bytes out.
"""

from __future__ import annotations

import json

from smtpguard.events.model import KEY_FIELD, KEY_HEADER

_HEADER_OF_KIND = {
    "mailgun": "X-Mailgun-Variables",
    "sendgrid": "X-SMTPAPI",
    "postmark": f"X-PM-Metadata-{KEY_FIELD}",
    "svix": KEY_HEADER,
    "ses": KEY_HEADER,
}


def tag_header(kind: str, qualified_key: str, content: bytes) -> bytes:
    """The header line to put before the message, or b"" when there is none to add: the
    key is not ASCII (it would need RFC 2047 encoding, and the providers echo such values
    inconsistently), or the message already carries that header (an application using the
    provider's own variables keeps them; the Message-ID still matches its events)."""
    name = _HEADER_OF_KIND.get(kind)
    if name is None or not qualified_key.isascii():
        return b""
    head = content.split(b"\r\n\r\n", 1)[0].lower()
    marker = name.lower().encode() + b":"
    if head.startswith(marker) or b"\r\n" + marker in head:
        return b""
    if kind == "mailgun":
        value = json.dumps({KEY_FIELD: qualified_key})
    elif kind == "sendgrid":
        value = json.dumps({"unique_args": {KEY_FIELD: qualified_key}})
    else:
        value = qualified_key
    return f"{name}: {value}\r\n".encode()
