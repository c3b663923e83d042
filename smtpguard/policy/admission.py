"""Admission (DESIGN.md §3): the checks a received message passes before the ledger is asked,
in their order — smuggling → parse → From → fingerprint → key → Message-ID → class → caps —
as one call that returns either the refusal or the facts the rest of the path works from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from smtpguard.policy.classes import message_class
from smtpguard.policy.decisions import Decision
from smtpguard.policy.eventkey import MissingKeyMode, event_key, message_id_for
from smtpguard.policy.fingerprint import earlier_fingerprint, fingerprint
from smtpguard.policy.limits import Caps, OwnCaps, UserLimits, caps_for, user_caps_of
from smtpguard.policy.message import HeaderLimits, Message, parse, smuggling_check
from smtpguard.policy.senders import check_header_from
from smtpguard.replies import Reply


class ZoneRules(OwnCaps, Protocol):
    """A zone as far as admission goes (config's ZoneConfig has this shape)."""

    @property
    def senders(self) -> Iterable[str]: ...
    @property
    def missing_key(self) -> MissingKeyMode: ...
    @property
    def delivery(self) -> str: ...
    @property
    def default_class(self) -> str | None: ...
    @property
    def plan(self) -> str: ...
    @property
    def users(self) -> Sequence[UserLimits]: ...


@dataclass(frozen=True, slots=True)
class Rules:
    """The settings admission reads from the whole config, as plain values."""

    header_limits: HeaderLimits
    key_headers: Sequence[str]
    class_header: str
    default_class: str
    max_ages: Mapping[str, float]
    """Each queue class and its max_age."""
    hostname: str
    """The domain of the Message-ID smtpguard makes for a message that has none."""


@dataclass(frozen=True, slots=True)
class Refused:
    reply: Reply
    decision: str
    key: str | None = None
    """Set once the key step passed: the refusal then carries the attempt's ids."""
    message_id: str | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    message: Message
    fingerprint: str
    key: str
    derived: bool
    message_id: str
    added_header: bytes
    """The Message-ID header to join to the message when it is sent or queued (else b"")."""
    lane: str | None
    """Queue mode: the message's class; None in relay mode."""
    max_age: float | None
    caps: Caps
    user_caps: Caps | None
    """The caps a reservation counts: the zone's, and the SMTP user's own inside them."""
    earlier_fingerprint: str | None = None
    """Where the earlier rule hashed this message otherwise (policy/fingerprint.py)."""
    owed: str | None = None
    """The fingerprint of the recipients held at RCPT by their receiver (DESIGN.md §21)."""
    accepted_fingerprint: str | None = None
    """With recipients held: the accepted ones' alone, as a release before `owed` hashed it."""


def admit(
    raw: bytes,
    mail_from: str,
    rcpt_tos: Sequence[str],
    zone_name: str,
    username: str | None,
    zone: ZoneRules,
    rules: Rules,
    attempt_id: str,
    held: Sequence[str] = (),
) -> Admitted | Refused:
    """Each step refuses before any later one is looked at (DESIGN.md §3 order). `held`: the
    recipients a receiver held at RCPT (DESIGN.md §21), which the client retries alone: the
    fingerprint covers every recipient named, and `owed` the held ones."""
    bad = smuggling_check(raw)
    if bad:
        return Refused(bad, Decision.BARE_NEWLINE)
    parsed = parse(raw, rules.header_limits)
    if isinstance(parsed, Reply):
        return Refused(parsed, Decision.MALFORMED)
    refused = check_header_from(parsed.get_all("From"), zone_name, zone.senders)
    if refused:
        return Refused(refused.reply, refused.decision)

    named = [*rcpt_tos, *held]
    fp = fingerprint(mail_from, named, parsed)
    found = event_key(parsed, rules.key_headers, zone.missing_key, fp)
    if isinstance(found, Reply):
        return Refused(found, Decision.KEY)
    if found is None:
        key, derived = f"msg:{attempt_id}", False
    else:
        key, derived = found.value, found.derived
    ids = parsed.get_all("Message-ID")
    message_id = ids[0] if ids else None
    added_header = b""
    if message_id is None:
        message_id = message_id_for(zone_name, key, rules.hostname)
        added_header = f"Message-ID: {message_id}\r\n".encode()

    lane: str | None = None
    max_age: float | None = None
    if zone.delivery == "queue":
        chosen = message_class(
            parsed, rules.class_header, zone.default_class, rules.default_class, rules.max_ages
        )
        if isinstance(chosen, Reply):
            return Refused(chosen, Decision.CLASS, key, message_id)
        lane, max_age = chosen, rules.max_ages[chosen]
    caps = caps_for(zone.plan, zone.hourly_cap, zone.monthly_cap)
    return Admitted(
        parsed,
        fp,
        key,
        derived,
        message_id,
        added_header,
        lane,
        max_age,
        caps,
        user_caps_of(zone.users, username, caps),
        earlier_fingerprint(mail_from, named, parsed),
        fingerprint(mail_from, held, parsed) if held else None,
        fingerprint(mail_from, rcpt_tos, parsed) if held else None,
    )
