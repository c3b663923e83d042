"""Amazon SES through SNS: the SNS envelope signed with the topic's certificate (Signature
over the canonical string of its signed fields), the subscription's TopicArn, and the SES
notification in `Message`, one event per recipient it names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smtpguard.events import signatures
from smtpguard.events.sources.base import (
    Rejected,
    Verified,
    _Base,
    _json_object,
    _named_headers,
    _obj,
    _str,
)
from smtpguard.events.times import epoch, event_time
from smtpguard.policy.events import ID_HEADER, Kind, Malformed, Match, ProviderEvent, strs

_SES_SECTIONS = {
    "Bounce": "bounce",
    "Complaint": "complaint",
    "Delivery": "delivery",
    "DeliveryDelay": "deliveryDelay",
}
"""Where each SES event keeps its own time (the field a refused time is named by)."""

# The fields SNS signs of each message type, in signing order (both subscription kinds alike).
_SNS_SUBSCRIPTION_SIGNED = ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type")
_SNS_SIGNED = {
    "Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    "SubscriptionConfirmation": _SNS_SUBSCRIPTION_SIGNED,
    "UnsubscribeConfirmation": _SNS_SUBSCRIPTION_SIGNED,
}


def sns_canonical(message: Mapping[str, Any]) -> bytes:
    """The string SNS signs: each signed field present, as `Name\\nvalue\\n`, in this order
    (Subject only when the notification has one)."""
    fields = _SNS_SIGNED.get(str(message.get("Type")), ())
    out = ""
    for name in fields:
        value = message.get(name)
        if value is None:
            if name == "Subject":
                continue
            raise Rejected(401, f"the signed field {name} is missing")
        out += f"{name}\n{value}\n"
    # surrogatepass: a lone surrogate (JSON allows `\ud800`) cannot be what SNS signed, but
    # it must fail the signature, not the handler.
    return out.encode("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class Ses(_Base):
    keys: Any
    topic_arn: str
    kind: str = "ses"

    def verify(self, body: bytes, headers: Mapping[str, str], now: float) -> Verified:
        envelope = _json_object(body)
        kind = envelope.get("Type")
        if kind not in _SNS_SIGNED:
            raise Rejected(400, f"SNS message Type {kind!r} is not one SNS sends")
        signature, version = envelope.get("Signature"), envelope.get("SignatureVersion")
        if not isinstance(signature, str) or not isinstance(version, str):
            raise Rejected(401, "Signature or SignatureVersion is missing")
        if not signatures.sns(self.keys, version, sns_canonical(envelope), signature):
            raise Rejected(401, "the signature does not verify with certificate_file")
        if envelope.get("TopicArn") != self.topic_arn:
            raise Rejected(403, f"TopicArn {envelope.get('TopicArn')!r} is not this source's topic")
        try:
            self._fresh(epoch(envelope.get("Timestamp"), "Timestamp"), now)
        except Malformed:
            raise Rejected(401, "Timestamp is not an ISO 8601 time") from None
        if kind != "Notification":
            url = envelope.get("SubscribeURL")
            return Verified([], notice=f"SNS {kind} for {self.topic_arn}: confirm by visiting {url}")
        message_id = str(envelope.get("MessageId"))
        try:
            message = json.loads(str(envelope.get("Message")))
        except ValueError:
            raise Malformed("Message is not JSON (enable raw SES notifications, not plain text)") from None
        return Verified(self._events(_obj(message, "Message"), message_id, now))

    def _events(self, m: dict[str, Any], message_id: str, now: float) -> list[ProviderEvent]:
        event = _str(m.get("notificationType")) or _str(m.get("eventType"))
        if event is None:
            raise Malformed("notificationType (or eventType) is missing")
        mail = m.get("mail") if isinstance(m.get("mail"), dict) else {}
        assert isinstance(mail, dict)
        common = mail.get("commonHeaders") if isinstance(mail.get("commonHeaders"), dict) else {}
        assert isinstance(common, dict)
        headers = _named_headers(mail.get("headers"))
        match = Match(
            sg_ids=strs(headers.get(ID_HEADER.lower())),
            message_ids=strs(common.get("messageId"), headers.get("message-id")),
            upstream_ids=strs(mail.get("messageId")),
        )
        found: list[tuple[str | None, str]] = []
        kind = Kind.OTHER
        section: dict[str, Any] = {}
        if event == "Bounce":
            section = _obj(m.get("bounce"), "bounce")
            kind = Kind.BOUNCE if section.get("bounceType") == "Permanent" else Kind.SOFT_BOUNCE
            for r in section.get("bouncedRecipients") or []:
                if isinstance(r, dict):
                    status = str(r.get("status") or section.get("bounceSubType") or "")
                    found.append((_str(r.get("emailAddress")), status))
        elif event == "Complaint":
            section = _obj(m.get("complaint"), "complaint")
            kind = Kind.COMPLAINT
            found = [
                (_str(r.get("emailAddress")), str(section.get("complaintFeedbackType") or ""))
                for r in section.get("complainedRecipients") or []
                if isinstance(r, dict)
            ]
        elif event in ("Delivery", "DeliveryDelay"):
            section = m.get("delivery") or m.get("deliveryDelay") or {}
            kind = Kind.DELIVERED if event == "Delivery" else Kind.DEFERRED
            recipients = section.get("recipients") if isinstance(section, dict) else None
            found = [(r, "") for r in recipients or [] if isinstance(r, str)]
            if not found and isinstance(section, dict):
                found = [
                    (_str(r.get("emailAddress")), "")
                    for r in section.get("delayedRecipients") or []
                    if isinstance(r, dict)
                ]
        if isinstance(section, dict) and section.get("timestamp"):
            at = event_time(section.get("timestamp"), f"{_SES_SECTIONS.get(event, 'bounce')}.timestamp", now)
        else:
            at = event_time(mail.get("timestamp"), "mail.timestamp", now)
        return [
            ProviderEvent(self.name, kind, event, rcpt, status, at, f"{message_id}:{i}", match)
            for i, (rcpt, status) in enumerate(found or [(None, "")])
        ]
