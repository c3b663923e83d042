"""The header that makes a provider echo a message's identity back in its events (§13).

Each provider carries custom data its own way. Mailgun (X-Mailgun-Variables), SendGrid
(X-SMTPAPI unique_args) and Postmark (X-PM-Metadata-*) strip their header before delivery
and echo the zone-qualified key in every event. SES and Resend echo the message's headers,
which also reach the recipient, so there the header carries only the sending attempt's
smtpguard id (X-Smtpguard-Id), never the key.

What a client wrote is never trusted as ours: every field whose name is one of ours in any
case or punctuation (X-Smtpguard-Id, X-Smtpguard-Key, X-PM-Metadata-smtpguard-key,
X-PM-Metadata-SMTPGuard.Key, …) is removed, and in the JSON headers every look-alike of
the `smtpguard_key` member is removed before ours is written, so one zone cannot point
events at another zone's records (DESIGN.md §18: tags have one spelling). A key that
cannot be a header value is written encoded (events.tag_value), never left out. Pure: bytes
in, bytes out.
"""

from __future__ import annotations

import json
from typing import Any

from smtpguard.policy.events import ID_HEADER, KEY_FIELD, is_our_tag_name, tag_value

_POSTMARK = f"X-PM-Metadata-{KEY_FIELD}"
_JSON_HEADERS = {"mailgun": "X-Mailgun-Variables", "sendgrid": "X-SMTPAPI"}
_JSON_NAMES = tuple(h.lower().encode() for h in _JSON_HEADERS.values())
_HINT = b"smtpguard"
"""Every name is_our_tag_name accepts holds these letters in order, with punctuation
between them at most: the fast path looks for the word with punctuation removed."""


def tagged(kind: str | None, qualified_key: str | None, attempt_id: str, content: bytes) -> bytes:
    """The message as relayed through a provider whose events a source of `kind` reads
    (None: no source reads them; only a client's forged fields are removed)."""
    head, sep, body = content.partition(b"\r\n\r\n")
    lowered = head.lower()
    if kind is None and _HINT not in _squeezed(lowered) and not any(n in lowered for n in _JSON_NAMES):
        # The common case, untouched. A JSON header is always looked into: a member's
        # name may be written with escapes (`smtp\u0067uard_key`) that no byte test sees.
        return content
    key = tag_value(qualified_key) if qualified_key is not None else None
    fields = [f for f in _fields(head) if not is_our_tag_name(_name(f).decode("latin-1"))]
    added: list[bytes] = []
    for header_kind, json_header in _JSON_HEADERS.items():
        name = json_header.lower().encode()
        if header_kind == kind:
            fields, client = _take(fields, name)
            merged = _merge(header_kind, client, key)
            if merged is not None:
                added.append(_fold(f"{json_header}: {json.dumps(merged, separators=(', ', ': '))}"))
        else:
            # No source reads this header here, but the provider may be one account with a
            # source's provider, whose webhook then echoes a client's member as our tag.
            fields = [c for f in fields if (c := _without_our_member(header_kind, json_header, f))]
    if kind == "postmark" and key is not None:
        added.append(f"{_POSTMARK}: {key}".encode())
    elif kind in ("svix", "ses"):
        added.append(f"{ID_HEADER}: {attempt_id}".encode())
    return b"\r\n".join([*added, *fields]) + sep + body


def _without_our_member(kind: str, json_header: str, field: bytes) -> bytes | None:
    """A client's JSON tag header for a provider whose tag smtpguard does not write: written
    again without a member of ours, and without duplicate names (a provider's parser may
    take the first of two where Python's takes the last); not JSON, it is dropped, since
    whether a provider's parser would find our member in it cannot be told."""
    if _name(field) != json_header.lower().encode():
        return field
    _, value = _take([field], json_header.lower().encode())
    cleaned = _merge(kind, value, None) if isinstance(value, dict) else None
    return _fold(f"{json_header}: {json.dumps(cleaned, separators=(', ', ': '))}") if cleaned else None


def _fields(head: bytes) -> list[bytes]:
    """The header block's fields, each with its folded continuation lines."""
    out: list[bytes] = []
    for line in head.split(b"\r\n"):
        if out and line[:1] in (b" ", b"\t"):
            out[-1] += b"\r\n" + line
        else:
            out.append(line)
    return out


def _squeezed(lowered: bytes) -> bytes:
    return lowered.replace(b"-", b"").replace(b"_", b"").replace(b".", b"")


def _name(field: bytes) -> bytes:
    return field.split(b":", 1)[0].strip().lower()


def _take(fields: list[bytes], name: bytes) -> tuple[list[bytes], Any]:
    """Remove every field called `name`; the JSON value of the first (None if none or not JSON)."""
    kept, value, found = [], None, False
    for f in fields:
        if _name(f) != name:
            kept.append(f)
            continue
        if not found:
            found = True
            raw = f.split(b":", 1)[1].replace(b"\r\n", b"")
            try:
                value = json.loads(raw)
            except ValueError:
                value = None
    return kept, value


def _merge(kind: str, client: Any, key: str | None) -> dict[str, Any] | None:
    doc: dict[str, Any] = dict(client) if isinstance(client, dict) else {}
    if kind == "mailgun":
        doc = _without_ours(doc)
        if key is not None:
            doc[KEY_FIELD] = key
        return doc or None
    args = doc.get("unique_args")
    unique: dict[str, Any] = _without_ours(args) if isinstance(args, dict) else {}
    if key is not None:
        unique[KEY_FIELD] = key
    if unique:
        doc["unique_args"] = unique
    else:
        doc.pop("unique_args", None)
    return doc or None


def _without_ours(members: dict[Any, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in members.items() if not is_our_tag_name(str(k))}


def _fold(line: str, width: int = 900) -> bytes:
    """Fold a long JSON header at its `, ` separators (RFC 5322 lines stay under 998)."""
    if len(line) <= width:
        return line.encode()
    parts, current = [], ""
    for piece in line.split(", "):
        candidate = f"{current}, {piece}" if current else piece
        if current and len(candidate) > width:
            parts.append(current + ",")
            current = piece
        else:
            current = candidate
    parts.append(current)
    return "\r\n ".join(parts).encode()
