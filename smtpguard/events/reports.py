"""RFC 3464 delivery status notifications and RFC 5965 ARF complaint reports, mailed to
`events.mailbox`, read into ProviderEvents (the same effects as a webhook, §13).

The standard library's `email` reads both formats exactly: `message/delivery-status` as a
block of per-message fields followed by one block per recipient (Final-Recipient, Action,
Status), and `message/feedback-report` as one block of fields. flufl.bounce was looked at:
its strength is guessing addresses out of non-standard bounces, which would turn a
free-text guess into a suppression; only standard reports are read here. Pure: bytes in,
events out.
"""

from __future__ import annotations

import email
import email.policy
import email.utils
import hashlib
from email.message import Message

from smtpguard.policy.events import ID_HEADER, Kind, Match, ProviderEvent
from smtpguard.policy.senders import address_problem


class NotAReport(Exception):
    """The message is neither a DSN nor an ARF report: accepted, counted, nothing applied."""


def read_report(raw: bytes, source: str, received_at: float, max_recipients: int) -> list[ProviderEvent]:
    """The report's events, one per recipient it names, the first `max_recipients` of them:
    no message smtpguard relayed had more (limits.max_recipients), and anyone can mail the
    mailbox, so a report naming thousands must not become thousands of store writes."""
    try:
        return _read(raw, source, received_at)[:max_recipients]
    except RecursionError:
        # The email parser recurses once per nested part: a 70 KB mail of parts a thousand
        # deep exhausts the stack. No MTA writes a report like that.
        raise NotAReport("parts nested too deeply") from None


def _read(raw: bytes, source: str, received_at: float) -> list[ProviderEvent]:
    msg = email.message_from_bytes(raw, policy=email.policy.compat32)
    if msg.get_content_type() != "multipart/report":
        raise NotAReport("not a multipart/report")
    param = msg.get_param("report-type")
    report_type = param.lower() if isinstance(param, str) else ""
    payload = msg.get_payload()
    if not isinstance(payload, list):
        raise NotAReport("a multipart/report without parts")
    parts = [p for p in payload if isinstance(p, Message)]
    original = _original_headers(parts)
    match = Match(
        sg_ids=tuple(v for v in [_text(original.get(ID_HEADER)).strip()] if v),
        message_ids=tuple(v for v in [_text(original.get("Message-ID")).strip()] if v),
    )
    if report_type == "delivery-status":
        form, found = "dsn", _dsn(parts)
    elif report_type == "feedback-report":
        form, found = "arf", _arf(parts, original)
    else:
        raise NotAReport(
            f"report-type {report_type or '(none)'} is neither delivery-status nor feedback-report"
        )
    # A report carries no id of its own: its events are named by the report without its
    # header block (a redelivery with other trace headers is the same report, and is
    # applied once) and each one's place in it.
    digest = hashlib.sha256(raw.split(b"\r\n\r\n", 1)[-1]).hexdigest()[:32]
    return [
        ProviderEvent(
            source, kind, f"{form}/{name or '-'}", rcpt, status, received_at, f"{form}:{digest}:{i}", match
        )
        for i, (kind, name, rcpt, status) in enumerate(found)
    ]


def _original_headers(parts: list[Message]) -> Message:
    """The headers of the message the report is about (message/rfc822 or
    text/rfc822-headers part); empty when the reporter returned neither."""
    for part in parts:
        ctype = part.get_content_type()
        if ctype == "message/rfc822":
            inner = part.get_payload()
            if isinstance(inner, list) and inner:
                first = inner[0]
                if isinstance(first, Message):
                    return first
        if ctype == "text/rfc822-headers":
            text = part.get_payload(decode=True)
            if isinstance(text, bytes):
                return email.message_from_bytes(text, policy=email.policy.compat32)
    return Message()


def _field_blocks(parts: list[Message], ctype: str) -> list[Message]:
    for part in parts:
        if part.get_content_type() == ctype:
            blocks = part.get_payload()
            if isinstance(blocks, list):
                return [b for b in blocks if isinstance(b, Message)]
    raise NotAReport(f"no {ctype} part")


def _text(value: object) -> str:
    """A header value as text: compat32 hands 8-bit values back as Header objects."""
    return "" if value is None else str(value)


def _address(value: object) -> str | None:
    """`rfc822; user@example.net` → user@example.net (RFC 3464 §2.3.2, address-type), or
    None when what is left is not an address (nothing is suppressed on a guess)."""
    text = _text(value)
    if not text:
        return None
    kind, sep, addr = text.partition(";")
    addr = (addr if sep else kind).strip().strip("<>").strip()
    return addr if addr and address_problem(addr) is None else None


_Found = tuple[Kind, str, str | None, str]
"""One recipient's event as a report gives it: its Kind, the report's own word for it (Action,
Feedback-Type), the recipient, the status."""


def _dsn(parts: list[Message]) -> list[_Found]:
    blocks = _field_blocks(parts, "message/delivery-status")
    found: list[_Found] = []
    for block in blocks[1:]:  # the first block holds the per-message fields
        recipient = _address(block.get("Final-Recipient") or block.get("Original-Recipient"))
        action = _text(block.get("Action")).strip().lower()
        status = _text(block.get("Status")).strip()
        if action == "failed":
            kind = Kind.BOUNCE if status.startswith("5") else Kind.SOFT_BOUNCE
        elif action == "delayed":
            kind = Kind.DEFERRED
        elif action in ("delivered", "relayed", "expanded"):
            kind = Kind.DELIVERED
        else:
            kind = Kind.OTHER
        found.append((kind, action, recipient, status))
    if not found:
        raise NotAReport("a delivery-status part without a recipient")
    return found


# RFC 5965 §7.3 registry: reports of mail the recipient did not want.
_COMPLAINTS = {"abuse", "fraud", "virus"}


def _arf(parts: list[Message], original: Message) -> list[_Found]:
    (fields, *_) = _field_blocks(parts, "message/feedback-report") or [Message()]
    feedback = _text(fields.get("Feedback-Type")).strip().lower()
    recipients = [_address(v) for v in fields.get_all("Original-Rcpt-To") or []]
    if not recipients:
        to = _text(original.get("To"))
        recipients = [_address(email.utils.parseaddr(to)[1]) if to else None]
    kind = Kind.COMPLAINT if feedback in _COMPLAINTS else Kind.OTHER
    return [(kind, feedback, rcpt, feedback) for rcpt in recipients]
