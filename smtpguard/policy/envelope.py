"""The MAIL FROM and RCPT TO checks of DESIGN.md §3, in the order they are applied.

MAIL: the zone's plan has send-as → a non-ASCII address comes with SMTPUTF8 (and a route
that can carry it) → the address is SMTP syntax without relay tricks → it is a mapped alias
of the zone. Send-as comes first because a zone without it may send nothing at all; the
SMTPUTF8 check comes before the syntax because, without SMTPUTF8, a non-ASCII address is not
SMTP syntax at all.

RCPT: the transaction's room for one more recipient → SMTPUTF8 → syntax. The checks that
need I/O come after these, in this order, in the listener: the suppression lists (store),
then with `recipient_domains: check` the domain's MX (DNS, §12), then the recipient's
receiving provider, paused or over its `max_rate` (§21). Each recipient is judged on its
own: those accepted before stay accepted (RFC 6531).

Authentication is the listener's check, before all of these: it knows the session.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from smtpguard import replies
from smtpguard.policy.senders import address_problem, sender_allowed, smtputf8_refusal
from smtpguard.replies import Reply


@dataclass(frozen=True, slots=True)
class Refusal:
    reply: Reply
    counted: bool = True
    """Counted as a rejected envelope (`rejected:envelope`). The recipient limit is not: it
    refuses no address, only this transaction's room for one more."""


def sender_refusal(
    address: str,
    zone: str,
    send_as: bool,
    senders: Iterable[str],
    declared_smtputf8: bool,
    route_smtputf8: bool | None,
) -> Refusal | None:
    """Why MAIL FROM:<address> is refused for `zone`, or None to accept it.

    `send_as`: the zone exists and its plan includes send-as; `senders`: its aliases;
    `route_smtputf8`: what the zone's route said about SMTPUTF8 (None: not known yet)."""
    if not send_as:
        return Refusal(replies.send_as_disabled(zone))
    unsendable = smtputf8_refusal(address, "sender", declared_smtputf8, route_smtputf8)
    if unsendable:
        return Refusal(unsendable)
    problem = address_problem(address)
    if problem:
        # The null sender is not bad syntax: it is no alias of any zone.
        return Refusal(
            replies.bad_address("sender", problem) if address else replies.sender_not_allowed(address, zone)
        )
    if not sender_allowed(address, senders):
        return Refusal(replies.sender_not_allowed(address, zone))
    return None


def recipient_refusal(
    address: str,
    accepted: int,
    limit: int,
    declared_smtputf8: bool,
    route_smtputf8: bool | None,
) -> Refusal | None:
    """Why RCPT TO:<address> is refused before any lookup, or None to go on to the lookups.

    `accepted`: recipients this transaction has accepted so far; `limit`: max_recipients."""
    if accepted >= limit:
        return Refusal(replies.too_many_recipients(limit), counted=False)
    unsendable = smtputf8_refusal(address, "recipient", declared_smtputf8, route_smtputf8)
    if unsendable:
        return Refusal(unsendable)
    problem = address_problem(address)
    if problem:
        return Refusal(replies.bad_address("recipient", problem))
    return None


def distinct_recipients(recipients: Sequence[str]) -> list[str]:
    """Each recipient once, in the order first named. The upstream must be told an address
    once however often the client named it (as Postfix's cleanup does): a provider that does
    not dedupe would deliver the event to that mailbox once per RCPT. Compared as relayed
    (normalize_address): the local part may be case-sensitive (RFC 5321 §2.4)."""
    return list(dict.fromkeys(recipients))
