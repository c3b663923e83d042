"""Every SMTP reply smtpguard gives, named once (DESIGN.md §3).

Policy code returns these values; only the listener turns them into wire text. Texts never
carry secrets and never echo raw client bytes other than a sanitised key or address.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

_UNSAFE = re.compile(r"[^\x21-\x7e ]")


def safe(text: str, limit: int = 200) -> str:
    """Make client- or upstream-supplied text safe to put on one reply line."""
    cleaned = _UNSAFE.sub("?", text)
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


def stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Reply:
    code: int
    enhanced: str
    text: str

    def __str__(self) -> str:
        return f"{self.code} {self.enhanced} {self.text}" if self.enhanced else f"{self.code} {self.text}"

    @property
    def ok(self) -> bool:
        return 200 <= self.code < 300

    @property
    def temporary(self) -> bool:
        return 400 <= self.code < 500

    @property
    def permanent(self) -> bool:
        return self.code >= 500

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "enhanced": self.enhanced, "text": self.text}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Reply:
        return cls(int(str(d["code"])), str(d.get("enhanced") or ""), str(d.get("text") or ""))


# --- session ---------------------------------------------------------------------------------
GREETING_BUSY = Reply(421, "4.7.0", "Too many connections, try again later")
AUTH_OK = Reply(235, "2.7.0", "Authentication successful")
AUTH_INVALID = Reply(535, "5.7.8", "Authentication credentials invalid")
AUTH_LOCKED = Reply(421, "4.7.0", "Too many authentication failures, try again later")
TOO_MANY_ERRORS = Reply(421, "4.7.0", "Too many errors in this session; closing the connection")
CREDENTIALS_CHANGED = Reply(421, "4.7.0", "Credentials changed by a reload; reconnect and authenticate again")
AUTH_NEEDS_TLS = Reply(538, "5.7.11", "Encryption required for requested authentication mechanism")
AUTH_REQUIRED = Reply(530, "5.7.0", "Authentication required")
AUTH_BAD_BASE64 = Reply(501, "5.5.2", "Can't decode base64")
AUTH_BAD_PLAIN = Reply(501, "5.5.2", "Can't split auth value")
TLS_FAILED = Reply(421, "4.7.0", "TLS negotiation failed")
SIZE_EXCEEDED = Reply(552, "5.3.4", "Message size exceeds fixed maximum message size")
LINE_TOO_LONG = Reply(500, "5.5.2", "Line too long (see RFC 5321 4.5.3.1.6)")
COMMAND_TOO_LONG = Reply(500, "5.5.2", "Command line too long")
MALFORMED_ADDRESS = Reply(501, "5.1.3", "Malformed address")
UNKNOWN_COMMAND = Reply(500, "5.5.1", "Command not recognized")
MAIL_SYNTAX = Reply(501, "5.5.4", "Syntax: MAIL FROM:<address> [SP <mail-parameters>]")
RCPT_SYNTAX = Reply(501, "5.5.4", "Syntax: RCPT TO:<address> [SP <rcpt-parameters>]")
IDLE_TIMEOUT = Reply(421, "4.4.2", "Idle timeout exceeded, closing connection")
DATA_TIMEOUT = Reply(421, "4.4.2", "Message transfer took too long, closing connection")
BARE_NEWLINE = Reply(550, "5.5.2", "Bare CR, bare LF or NUL in message data not allowed")
BARE_NEWLINE_COMMAND = Reply(501, "5.5.2", "Bare CR, LF or NUL in command not allowed")
SHUTTING_DOWN = Reply(421, "4.3.2", "Service shutting down, try again later")
STORE_UNAVAILABLE = Reply(451, "4.3.0", "State store unavailable, nothing sent; try again later")
INTERNAL_ERROR = Reply(
    451, "4.3.0", "Internal error; try again later (a retry of the same event is never sent twice)"
)
OK_SENDER = Reply(250, "2.1.0", "Sender OK")
OK_RECIPIENT = Reply(250, "2.1.5", "Recipient OK")
NO_RECIPIENTS = Reply(554, "5.5.1", "No valid recipients")


def bad_address(what: str, reason: str) -> Reply:
    return Reply(501, "5.1.3" if what == "recipient" else "5.1.7", f"Bad {what} address: {reason}")


def _not_mapped(what: str, address: str, zone: str) -> Reply:
    """The envelope sender or the header From is no alias mapped to the user's zone."""
    return Reply(550, "5.7.1", f"{what} <{safe(address)}> is not a mapped alias of zone {zone}")


def sender_not_allowed(address: str, zone: str) -> Reply:
    return _not_mapped("Sender", address, zone)


def from_not_allowed(address: str, zone: str) -> Reply:
    return _not_mapped("Header From", address, zone)


def send_as_disabled(zone: str) -> Reply:
    return Reply(550, "5.7.1", f"Zone {zone} plan does not include send-as")


def suppressed(address: str, listname: str) -> Reply:
    return Reply(550, "5.1.1", f"Recipient <{safe(address)}> is on the {listname} suppression list")


def non_ascii_address(what: str, address: str, why: str) -> Reply:
    """RFC 6531's refusal of an address that cannot be relayed without SMTPUTF8 (X.6.7)."""
    return Reply(553, "5.6.7", f"Non-ASCII {what} address <{safe(address)}> not permitted: {why}")


def smtputf8_not_offered(provider: str) -> Reply:
    """The relay's refusal when the provider's EHLO does not offer SMTPUTF8 (RFC 6531)."""
    return Reply(553, "5.6.7", f"Upstream {provider} does not offer SMTPUTF8, which this message needs")


def eightbitmime_not_offered(provider: str) -> Reply:
    """The relay's refusal of an 8-bit message to a provider whose EHLO does not offer
    8BITMIME (RFC 6152 §3: refuse or convert; smtpguard never rewrites a message). X.6.3:
    conversion required but not supported (RFC 3463)."""
    return Reply(
        554, "5.6.3", f"Upstream {provider} does not offer 8BITMIME, and this message has 8-bit data"
    )


def recipient_null_mx(domain: str) -> Reply:
    """RFC 7505 §4.3: the domain publishes a null MX, it accepts no mail (X.1.10)."""
    return Reply(556, "5.1.10", f"Recipient domain {safe(domain)} accepts no mail (null MX)")


def recipient_domain_unroutable(domain: str, why: str) -> Reply:
    """RFC 3463 X.1.2: the destination domain does not exist or cannot receive mail."""
    return Reply(550, "5.1.2", f"Recipient domain {safe(domain)} cannot receive mail: {safe(why)}")


def too_many_recipients(limit: int) -> Reply:
    return Reply(452, "4.5.3", f"Too many recipients (limit {limit})")


def too_many_recipients_in_row(limit: int) -> Reply:
    """An outbox row cannot send the rest in a second transaction as an SMTP client would:
    more recipients than the limit is final for it."""
    return Reply(550, "5.5.3", f"Too many recipients in one row (limit {limit})")


# --- message and event key -------------------------------------------------------------------
def _malformed(what: str, reason: str) -> Reply:
    return Reply(550, "5.6.0", f"Malformed {what}: {reason}")


def malformed_message(reason: str) -> Reply:
    return _malformed("message", safe(reason))


def missing_key(header: str) -> Reply:
    return Reply(550, "5.7.0", f"Missing {header} header naming the business event")


def malformed_key(header: str, reason: str) -> Reply:
    return _malformed(header, reason)


def _duplicate(key: str, sg_id: str, already: str) -> Reply:
    """A key seen before answers 250 with the original smtpguard id, and nothing is sent."""
    return Reply(250, "2.0.0", f"[sg:{sg_id}] duplicate of event {safe(key)} already {already}")


def duplicate(key: str, sg_id: str, upstream_id: str | None) -> Reply:
    upstream = f", upstream id {safe(upstream_id)}" if upstream_id else ""
    return _duplicate(key, sg_id, f"accepted{upstream}")


def duplicate_queued(key: str, sg_id: str) -> Reply:
    return _duplicate(key, sg_id, "queued")


def settled_delivered(sg_id: str, upstream_id: str | None, by: str) -> Reply:
    """An unknown outcome settled as delivered (an operator's resolve, an accepted verdict):
    the 250 the provider's lost reply would have been, for the outbox row that follows it."""
    upstream = f", upstream id {safe(upstream_id)}" if upstream_id else ""
    return Reply(250, "2.0.0", f"[sg:{sg_id}] accepted{upstream}; outcome settled by {safe(by, 64)}")


def key_reused(key: str) -> Reply:
    return Reply(550, "5.7.0", f"Event key {safe(key)} reused with a different message; nothing sent")


def _not_now(key: str, why: str) -> Reply:
    """Nothing is sent for the event now; a later retry is decided afresh (4.7.1)."""
    return Reply(451, "4.7.1", f"Event {safe(key)} {why}")


def in_flight(key: str) -> Reply:
    return _not_now(key, "is being sent by another submission; try later")


def retry_too_soon(key: str, not_before: float) -> Reply:
    return _not_now(key, f"was deferred; retry after {stamp(not_before)}")


def outcome_unknown(key: str) -> Reply:
    return Reply(451, "4.3.0", f"Outcome of event {safe(key)} is unknown; held for operator review")


def expired(key: str) -> Reply:
    return Reply(550, "5.4.7", f"Event {safe(key)} expired before it could be delivered")


def _paused(zone: str, message_class: str | None) -> Reply:
    of_class = "" if message_class is None else f"of class {safe(message_class, 64)} "
    return Reply(451, "4.7.0", f"Sending {of_class}for zone {zone} is paused")


def paused(zone: str) -> Reply:
    return _paused(zone, None)


def class_paused(zone: str, message_class: str) -> Reply:
    """One message class held by `pause ZONE --class C` (DESIGN.md §16); others flow."""
    return _paused(zone, message_class)


def receiver_held(receiver: str, why: str) -> Reply:
    """A recipient of a receiving provider held at RCPT (DESIGN.md §21): paused, or over
    its `max_rate`; try later. Only this recipient: the transaction's others go on."""
    return Reply(451, "4.7.1", f"Mail to {safe(receiver, 32)} recipients is held ({why}); try again later")


def _capped(zone: str, user: str | None) -> str:
    """Whose cap was reached: the zone's, or an SMTP user's own inside it (DESIGN.md §16)."""
    return f"zone {zone}" if user is None else f"user {safe(user, 128)} of zone {zone}"


def hourly_cap(zone: str, cap: int, free_at: float, user: str | None = None) -> Reply:
    return Reply(
        451,
        "4.7.0",
        f"Hourly cap of {cap} reached for {_capped(zone, user)}; a slot frees at {stamp(free_at)}",
    )


def monthly_cap(zone: str, cap: int, user: str | None = None) -> Reply:
    return Reply(550, "5.7.0", f"Monthly cap of {cap} reached for {_capped(zone, user)}")


def no_provider() -> Reply:
    return Reply(451, "4.4.1", "No upstream provider available; nothing sent, try again later")


def queued(sg_id: str) -> Reply:
    return Reply(250, "2.0.0", f"queued as {sg_id}")


def upstream(code: int, enhanced: str, sg_id: str, text: str) -> Reply:
    """An upstream reply passed through: its code and enhanced code, our id, its text."""
    return Reply(code, enhanced, f"[sg:{sg_id}] {safe(text)}".rstrip())


# aiosmtpd answers a few conditions itself, without enhanced codes; the listener rewrites
# them so every reply a client sees comes from this module.
AIOSMTPD_REWRITES: dict[str, Reply] = {
    "552 Error: Too much mail data": SIZE_EXCEEDED,
    "552 Error: message size exceeds fixed maximum message size": SIZE_EXCEEDED,
    "500 Line too long (see RFC5321 4.5.3.1.6)": LINE_TOO_LONG,
    "530 5.7.0 Authentication required": AUTH_REQUIRED,
    "500 Command line too long": COMMAND_TOO_LONG,
    "553 5.1.3 Error: malformed address": MALFORMED_ADDRESS,
    "501 Syntax: MAIL FROM: <address>": MAIL_SYNTAX,
    "501 Syntax: MAIL FROM: <address> [SP <mail-parameters>]": MAIL_SYNTAX,
    "501 Syntax: RCPT TO: <address>": RCPT_SYNTAX,
    "501 Syntax: RCPT TO: <address> [SP <mail-parameters>]": RCPT_SYNTAX,
}
# aiosmtpd echoes an unknown command word back; that word may be a stray credential (an AUTH
# LOGIN answer sent after a refused AUTH), so it is not repeated.
AIOSMTPD_PREFIX_REWRITES: tuple[tuple[str, Reply], ...] = (('500 Error: command "', UNKNOWN_COMMAND),)
