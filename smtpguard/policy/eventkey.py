"""The business event key: taken from its header, validated, or derived (DESIGN.md §4)."""

from __future__ import annotations

import base64
import binascii
import codecs
import encodings
import encodings.aliases
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from smtpguard import replies
from smtpguard.policy.message import Message
from smtpguard.replies import Reply

MAX_KEY_LENGTH = 200
_ENCODED_WORD = r"=\?[^?\s]+\?[QqBb]\?[^?\s]*\?="
_FOLDED_WORDS = re.compile(rf"{_ENCODED_WORD}(?:\s+{_ENCODED_WORD})+")
_WORD = re.compile(r"=\?([^?\s]+)\?([QqBb])\?([^?\s]*)\?=")
_KEY_CHARSETS = frozenset(
    {"utf-8", "ascii", "koi8-r", "koi8-u", "shift_jis", "euc_jp", "iso2022_jp", "euc_kr"}
    | {"gb2312", "gbk", "gb18030", "big5"}
    | {f"iso8859-{n}" for n in (*range(1, 11), *range(13, 17))}
    | {f"cp{n}" for n in range(1250, 1259)}
)
"""The charsets (as Python's codec registry names them) a mail library writes a header
in: UTF-8, ASCII, ISO 8859, the Windows code pages and the common Cyrillic and East Asian
ones. Not every codec Python has: some are no text encoding at all (rot13, base64, zlib)
and some are Python's own (unicode_escape, punycode), which no mail library writes and
whose decoding means nothing to anyone reading the header."""
_CODEC_MODULES = frozenset(encodings.aliases.aliases.values()) | {
    encodings.normalize_encoding(name) for name in _KEY_CHARSETS
}
"""What a charset name can resolve to and be one of _KEY_CHARSETS: the codec modules the
alias table names, and those charsets' own. A name resolving to none is never looked up."""
MissingKeyMode = Literal["reject", "derive", "allow"]


@dataclass(frozen=True, slots=True)
class EventKey:
    value: str
    derived: bool


def key_problem(value: str) -> str | None:
    """Why a key is unusable, or None. Whitespace is refused so folding cannot alter a key."""
    if not value:
        return "the key is empty"
    if len(value) > MAX_KEY_LENGTH:
        return f"the key is longer than {MAX_KEY_LENGTH} characters"
    if any(c.isspace() or not c.isprintable() for c in value):
        return "the key contains whitespace or control characters"
    return None


def event_key(
    message: Message, header: str | Sequence[str], mode: MissingKeyMode, fingerprint: str
) -> EventKey | Reply | None:
    """The submission's key; None when the zone allows keyless mail; a Reply to refuse it.

    `header` may name several headers (aliases, e.g. an app moving from an HTTP API that
    already sends `Idempotency-Key`): the first present in that order wins. Two of them
    present with different values cannot be one event and are refused; the same value is
    the same key said twice and is taken."""
    names = (header,) if isinstance(header, str) else tuple(header)
    found: list[tuple[str, str]] = []
    for name in names:
        values = message.get_all(name)
        if len(values) > 1:
            return replies.malformed_key(name, "the header appears more than once")
        if values:
            value = written_key(values[0])
            if value is None:
                return replies.malformed_key(name, "its encoded-words cannot be decoded")
            problem = key_problem(value)
            if problem:
                return replies.malformed_key(name, problem)
            found.append((name, value))
    if found:
        first_name, first = found[0]
        for other_name, other in found[1:]:
            if other != first:
                return replies.malformed_key(
                    f"{first_name} and {other_name}", "the two headers carry different keys"
                )
        return EventKey(first, derived=False)
    if mode == "reject":
        return replies.missing_key(" or ".join(names))
    if mode == "derive":
        return EventKey(derived_key(fingerprint), derived=True)
    return None


def derived_key(fingerprint: str) -> str:
    """The key `missing_key: derive` gives a message of this fingerprint."""
    return "auto:" + fingerprint


def written_key(value: str) -> str | None:
    """The key an application wrote, from the header value as it arrived; None when it
    cannot be decoded.

    A mail library writes a key too long for one header line as RFC 2047 encoded-words
    folded over several lines (Python's email package does so past about 77 characters:
    `=?utf-8?q?invoice=3A…?=` CRLF SP `=?utf-8?q?…?=`). The whitespace between adjacent
    encoded-words is not part of the text (RFC 2047 §6.2), so two or more of them, and
    nothing else, are decoded. Any other value is the key as written, a single
    encoded-word included: such a value was always taken literally, and a retry sent
    across an upgrade must keep its key. Read as written, the folded form held whitespace
    and was refused, so decoding it changes no key that ever had a record."""
    if _FOLDED_WORDS.fullmatch(value) is None:
        return value
    runs: list[tuple[str, bytearray]] = []
    for charset, encoding, text in _WORD.findall(value):
        # RFC 2231 §5: a charset may carry a language (`utf-8*en`); it names no charset.
        codec = _mail_codec(charset.partition("*")[0])
        if codec is None:
            return None
        charset = codec.name
        try:
            if encoding in "Bb":
                octets = base64.b64decode(text, validate=True)
            else:
                octets = binascii.a2b_qp(text.encode("ascii"), header=True)
        except (ValueError, binascii.Error, UnicodeEncodeError):
            return None
        # One character may be split over two words of one charset: decoded as one run.
        if runs and runs[-1][0] == charset:
            runs[-1][1].extend(octets)
        else:
            runs.append((charset, bytearray(octets)))
    try:
        return "".join(bytes(octets).decode(charset) for charset, octets in runs)
    except UnicodeDecodeError:
        return None


def _mail_codec(charset: str) -> codecs.CodecInfo | None:
    """The codec of one of _KEY_CHARSETS that `charset` names (any spelling Python's
    registry takes), or None. The registry is asked only about a name that resolves to a
    codec module: it keeps every name it fails to find for the life of the process
    (encodings._cache), and the names here are the client's, each message's its own."""
    if not charset.isascii():
        return None
    # As codecs.lookup() resolves a name (Python >= 3.9): lowercased, normalised, aliased.
    norm = encodings.normalize_encoding(charset.lower())
    aliases = encodings.aliases.aliases
    module = aliases.get(norm) or aliases.get(norm.replace(".", "_")) or norm
    if module not in _CODEC_MODULES:
        return None
    try:
        info = codecs.lookup(module)
    except LookupError:
        return None  # an alias of a codec this platform lacks (mbcs, oem)
    return info if info.name in _KEY_CHARSETS else None


def message_id_for(zone: str, key: str, domain: str) -> str:
    """A Message-ID derived from zone + key, so a copy made anywhere is recognisable."""
    digest = hashlib.sha256(f"{zone}\x00{key}".encode()).hexdigest()[:32]
    return f"<sg.{digest}@{domain}>"


def qualified_key(zone: str, key: str) -> str:
    """The key as sent to a provider that dedupes on a header: unique across zones."""
    return f"{zone}:{key}"
