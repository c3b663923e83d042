"""One outbox row through the SMTP pipeline, as its source's zone user would submit it.

The envelope checks are the listener's, in its order (policy/envelope.py for MAIL and each
RCPT, then the suppression lists and the recipient-domain check); DATA is Submitter.submit,
the very call the listener makes at the final dot. Nothing here decides what SMTP would
not: a row is answered with the reply its message would have got on the wire.

Unlike an SMTP client, a row cannot drop one refused recipient and carry on with the
others: its receipt is one reply, so the first refused recipient answers for the row.
"""

from __future__ import annotations

import logging
from typing import Protocol

from smtpguard import replies
from smtpguard.config import OutboxSource, plan_send_as
from smtpguard.policy.decisions import Decision
from smtpguard.policy.envelope import recipient_refusal, sender_refusal
from smtpguard.policy.outbox import size_refusal, wire_form, with_key
from smtpguard.policy.senders import normalize_address, route_offers_smtputf8
from smtpguard.receivers import Receivers
from smtpguard.recipient_domains import RecipientDomains
from smtpguard.store import StoreUnavailable
from smtpguard.submission import Principal, Result, Submitter

log = logging.getLogger("smtpguard.outbox")

SIZE = "rejected:size"


class EnvelopeChecks(Protocol):
    """The listener's RCPT checks beyond the envelope rules (its Handler has both): the
    recipient-domain check (§12) and the receiving providers' holds (§21)."""

    recipient_domains: RecipientDomains | None
    receivers: Receivers | None


async def submit_row(
    submitter: Submitter,
    source: str,
    src: OutboxSource,
    event_key: str,
    message: bytes,
    stored_size: int,
    mail_from: str | None,
    rcpt_to: tuple[str | None, ...],
    checks: EnvelopeChecks | None = None,
) -> tuple[Principal, Result]:
    """`stored_size`: the message's octets in its row; the claim leaves a message over the
    size limit unread, `message` is then empty and this alone refuses it."""
    principal = Principal(src.zone, src.user, session=f"outbox:{source}")
    domains = checks.recipient_domains if checks is not None else None
    receivers = checks.receivers if checks is not None else None

    async def envelope_then_data() -> Result:
        config = submitter.config
        zone = config.zones.get(src.zone)
        if zone is None:
            return Result(replies.send_as_disabled(src.zone), Decision.ZONE_GONE)
        raw = wire_form(message)
        # Line ends made CRLF only add octets: a row stored over the limit is over it on the wire.
        too_big = size_refusal(max(len(raw), stored_size), config.limits.max_message_size)
        if too_big is not None:
            return Result(too_big, SIZE, event_key)
        keyed = with_key(raw, config.event_key.headers[0], event_key, config.limits.headers)
        if isinstance(keyed, replies.Reply):
            return Result(keyed, Decision.KEY)
        # The outbox is its own SMTP client: it declares SMTPUTF8 when an address needs it.
        smtputf8 = not all(a is not None and a.isascii() for a in (mail_from, *rcpt_to))
        route = route_offers_smtputf8(p.smtputf8 for p in submitter.route.providers_for(src.zone))
        if mail_from is None:
            return Result(replies.bad_address("sender", "NULL in mail_from"), Decision.ENVELOPE, event_key)
        refusal = sender_refusal(mail_from, src.zone, plan_send_as(zone), zone.senders, smtputf8, route)
        if refusal is not None:
            return Result(refusal.reply, Decision.ENVELOPE, event_key)
        if not rcpt_to:
            return Result(replies.NO_RECIPIENTS, Decision.ENVELOPE, event_key)
        accepted: list[str] = []
        for address in rcpt_to:
            if address is None:
                return Result(
                    replies.bad_address("recipient", "NULL in rcpt_to"), Decision.ENVELOPE, event_key
                )
            refused = recipient_refusal(address, len(accepted), config.limits.max_recipients, smtputf8, route)
            reply = refused.reply if refused is not None else None
            if refused is not None and not refused.counted:
                reply = replies.too_many_recipients_in_row(config.limits.max_recipients)
            if reply is None:
                listed = await submitter.suppressions.find(src.zone, address)
                reply = replies.suppressed(address, listed) if listed else None
            if reply is None and zone.recipient_domains == "check" and domains is not None:
                reply = await domains.refusal(address)
            if reply is not None:
                return Result(reply, Decision.ENVELOPE, event_key)
            if receivers is not None:
                # Its receiver paused or over max_rate (relay mode): the row waits, as RCPT
                # holds the recipient; a hold by a control, not a refusal of the address.
                held = await receivers.rcpt_refusal(src.zone, address, zone.delivery == "queue")
                if held is not None:
                    return Result(held, Decision.PAUSED, event_key)
            accepted.append(normalize_address(address))
        result = await submitter.submit(principal, mail_from, accepted, keyed, smtputf8)
        if receivers is not None and result.decision == Decision.RELAYED:
            receivers.sent(src.zone, [r for r in accepted if r not in result.refused])
        return result

    try:
        return principal, await envelope_then_data()
    except StoreUnavailable:
        return principal, Result(replies.STORE_UNAVAILABLE, Decision.STORE_UNAVAILABLE, event_key)
    except Exception:
        # As the listener does for a session: a defect answers 451 (the row is tried again,
        # and the ledger never sends one event twice), it does not stop the reader.
        log.exception("internal error while submitting an outbox row", extra={"source": source})
        return principal, Result(replies.INTERNAL_ERROR, "internal_error", event_key)
