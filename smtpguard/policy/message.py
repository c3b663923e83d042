"""The header block of a submitted message: smuggling checks, limits and parsing.

Only headers are parsed, never the MIME tree: everything smtpguard decides on (event key,
From, the fingerprint's header fields) lives in the top-level header block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from smtpguard import replies
from smtpguard.replies import Reply


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    max_header_size: int = 64 * 1024
    max_header_count: int = 500


@dataclass(frozen=True, slots=True)
class Message:
    headers: tuple[tuple[str, str], ...]
    """(name as sent, unfolded value) in order; values are decoded UTF-8."""
    header_block: bytes
    body: bytes

    def get_all(self, name: str) -> list[str]:
        lname = name.lower()
        return [v for n, v in self.headers if n.lower() == lname]

    def has(self, name: str) -> bool:
        lname = name.lower()
        return any(n.lower() == lname for n, _ in self.headers)


def smuggling_check(data: bytes) -> Reply | None:
    """Reject bare CR, bare LF and NUL anywhere in DATA (Postfix smtpd_forbid_bare_newline).

    aiosmtpd ends DATA only on <CRLF>.<CRLF> but hands every other byte through, so a
    `\\n.\\r\\n` smuggling attempt arrives here as ordinary content. Counting is enough:
    in a clean stream every CR and every LF belongs to exactly one CRLF pair.
    """
    crlf = data.count(b"\r\n")
    if data.count(b"\n") != crlf or data.count(b"\r") != crlf or b"\x00" in data:
        return replies.BARE_NEWLINE
    return None


def parse(data: bytes, limits: HeaderLimits) -> Message | Reply:
    """Split a CRLF-clean message into unfolded headers and body, or say why not."""
    if data.startswith(b"\r\n"):
        return replies.malformed_message("message has no header block")
    end = data.find(b"\r\n\r\n")
    if end < 0:
        block, body = data, b""
    else:
        block, body = data[: end + 2], data[end + 4 :]
    if len(block) > limits.max_header_size:
        return replies.malformed_message(f"header block exceeds {limits.max_header_size} bytes")
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        return replies.malformed_message("header block is not valid UTF-8")

    headers: list[tuple[str, str]] = []
    name: str | None = None
    parts: list[str] = []
    for line in text.split("\r\n"):
        if not line:
            continue
        if line[0] in " \t":
            if name is None:
                return replies.malformed_message("header block starts with a continuation line")
            parts.append(line)
            continue
        if name is not None:
            headers.append((name, "".join(parts).strip()))
        colon = line.find(":")
        if colon <= 0:
            return replies.malformed_message("header line without a field name")
        name = line[:colon]
        if not _valid_field_name(name):
            return replies.malformed_message("invalid header field name")
        parts = [line[colon + 1 :]]
        if len(headers) >= limits.max_header_count:
            return replies.malformed_message(f"more than {limits.max_header_count} header fields")
    if name is not None:
        headers.append((name, "".join(parts).strip()))
    return Message(tuple(headers), block, body)


_FIELD_NAME = re.compile(r"[\x21-\x7e]+")


def _valid_field_name(name: str) -> bool:
    # RFC 5322 §3.6.8: printable US-ASCII except colon; no spaces.
    return _FIELD_NAME.fullmatch(name) is not None
