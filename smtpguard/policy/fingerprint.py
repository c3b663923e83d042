"""What "the same message" means for an event key (DESIGN.md §3, last paragraph).

The fingerprint covers the envelope sender, the sorted recipients, header From/To/Cc/Subject
and the body. It ignores Date, Message-ID and trace headers, which legacy clients regenerate
on every attempt. MIME boundaries are replaced by a placeholder before hashing: PHPMailer,
nodemailer and Python's email package draw a random boundary per attempt, and without this a
retry of a deferred event would look like a reused key and never be delivered. Only a
boundary doing its job is replaced: in a header's `boundary=` parameter and at the start of
a delimiter line. A `boundary=` in a plain body or inside a part's content is text.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from smtpguard.policy.message import Message
from smtpguard.policy.senders import normalize_address

FINGERPRINT_HEADERS = ("from", "to", "cc", "subject")
_BOUNDARY = re.compile(rb'boundary\s*=\s*(?:"([^"\r\n]{1,200})"|([^\s;"]{1,200}))', re.IGNORECASE)
_SPACES = re.compile(r"\s+")


def fingerprint(mail_from: str, rcpt_tos: Iterable[str], message: Message) -> str:
    return _hashed(mail_from, rcpt_tos, message, _neutral_boundaries(message.header_block, message.body))


def earlier_fingerprint(mail_from: str, rcpt_tos: Iterable[str], message: Message) -> str | None:
    """The fingerprint the rule before this one gave the message, where it differs: only
    for a `boundary=` outside any header, which that rule neutralised too. Its records are
    in the store an upgrade keeps (and an instance of the earlier release may still be
    serving it): a keyed retry of such a message is the same event, not a reused key."""
    if b"boundary" not in message.body.lower():
        return None
    body = _neutral_boundaries(message.header_block, message.body)
    before = _earlier_neutral_boundaries(message.header_block, message.body)
    return None if before == body else _hashed(mail_from, rcpt_tos, message, before)


def _hashed(mail_from: str, rcpt_tos: Iterable[str], message: Message, body: bytes) -> str:
    h = hashlib.sha256()
    h.update(b"v1\x00")
    h.update(normalize_address(mail_from).encode("utf-8", "surrogateescape") + b"\x00")
    for rcpt in sorted({normalize_address(r) for r in rcpt_tos}):
        h.update(rcpt.encode("utf-8", "surrogateescape") + b"\x01")
    h.update(b"\x00")
    for name in FINGERPRINT_HEADERS:
        for value in message.get_all(name):
            h.update(name.encode() + b":" + _SPACES.sub(" ", value).strip().encode() + b"\x00")
    h.update(b"\x00")
    h.update(body)
    return h.hexdigest()


def _earlier_neutral_boundaries(header_block: bytes, body: bytes) -> bytes:
    boundaries = _declared(header_block + b"\r\n" + body)
    body = _BOUNDARY.sub(_NEUTRAL_PARAMETER, body)
    # Longest first, so a boundary that starts with another is replaced whole.
    for b in sorted(boundaries, key=len, reverse=True):
        body = re.sub(rb"(?m)^--" + re.escape(b), _NEUTRAL_DELIMITER, body)
    return body


def _neutral_boundaries(header_block: bytes, body: bytes) -> bytes:
    # A literal search of the lower-cased bytes (ASCII folding, as re.IGNORECASE on bytes):
    # a case-insensitive regex scan of a 2 KB body took 11 µs, this takes 2.
    embeds = False
    # Not multipart (the common transactional message): a `boundary=` in its body is text
    # like any other, and neutralising it would let two messages differing only there
    # (`?boundary=1` and `?boundary=2` in a link) share a fingerprint. Unless the body is a
    # message of its own, whose header block may declare one.
    if b"boundary" not in header_block.lower() and (
        b"boundary" not in body.lower() or not (embeds := _embeds_message([header_block]))
    ):
        return body
    known = _declared(header_block)
    if not known and not embeds:
        return body
    # Only where a boundary does its job (RFC 2046 §5.1.1): in a `boundary=` parameter of a
    # header (the message's, or a part's, which may declare a nested multipart) and at the
    # start of a delimiter line. The same bytes inside a part's content are content.
    out: list[bytes] = []
    # A part's header block is taken whole, at its blank line: a `boundary=` may be folded
    # (`boundary=` CRLF SP `"b"`), and its parameter is replaced across the fold as the
    # rule before this one replaced it.
    header: list[bytes] | None = [] if embeds else None

    def end_of_header() -> bool:
        nonlocal known
        assert header is not None
        block = b"\n".join(header)
        if b"boundary" in block.lower():
            known |= _declared(block)
            block = _BOUNDARY.sub(_NEUTRAL_PARAMETER, block)
        if header:
            out.append(block)
        # A message/rfc822 part (a mail forwarded as an attachment): its content opens
        # with the embedded message's header block, which declares its own boundary,
        # drawn afresh per attempt as the outer one is.
        return _embeds_message(header)

    for line in body.split(b"\n"):
        boundary = _delimiter_of(line, known)
        if boundary is not None:
            if header is not None:
                end_of_header()
            rest = line[2 + len(boundary) :]
            out.append(_NEUTRAL_DELIMITER + rest)
            # A close delimiter: the epilogue follows, no header.
            header = None if rest.startswith(b"--") else []
        elif header is None:
            out.append(line)
        elif line in (b"", b"\r"):
            embedded = end_of_header()
            out.append(line)
            header = [] if embedded else None
        else:
            header.append(line)
            if b"boundary" in line.lower():
                # Known at once: a part header cut short by a delimiter (no blank line).
                known |= _declared(line)
    if header is not None:
        end_of_header()
    return b"\n".join(out)


_NEUTRAL_PARAMETER = b'boundary="\x00BOUNDARY\x00"'
_NEUTRAL_DELIMITER = b"--\x00BOUNDARY\x00"


_EMBEDDED = re.compile(rb"(?:^|\n)content-type\s*:\s*message/(?:rfc822|global)\b", re.IGNORECASE)


def _embeds_message(header_lines: list[bytes]) -> bool:
    return _EMBEDDED.search(b"\n".join(header_lines)) is not None


def _declared(header_lines: bytes) -> set[bytes]:
    return {m.group(1) or m.group(2) for m in _BOUNDARY.finditer(header_lines)}


def _delimiter_of(line: bytes, known: set[bytes]) -> bytes | None:
    """The longest known boundary `line` is a delimiter of (one boundary may begin with
    another), else None."""
    if not line.startswith(b"--"):
        return None
    found = [b for b in known if line.startswith(b, 2)]
    return max(found, key=len) if found else None
