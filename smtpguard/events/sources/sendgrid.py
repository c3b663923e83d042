"""SendGrid's Event Webhook: an ECDSA P-256 signature over the timestamp and the raw body, in
the X-Twilio-Email-Event-Webhook-* headers; a JSON array of events."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smtpguard.events import signatures
from smtpguard.events.sources.base import Rejected, Verified, _Base, _header, _json, _obj, _str
from smtpguard.events.sources.kinds import Kinds, event_kind
from smtpguard.events.times import event_time
from smtpguard.policy.events import KEY_FIELD, Kind, Match, ProviderEvent, content_id, strs

_SENDGRID_KINDS: Kinds = {
    "spamreport": Kind.COMPLAINT,
    "unsubscribe": Kind.UNSUBSCRIBE,
    "group_unsubscribe": Kind.UNSUBSCRIBE,
    "delivered": Kind.DELIVERED,
    "deferred": Kind.DEFERRED,
    # `blocked` is the receiver refusing this message (content, reputation), not a dead
    # address: history only, like a soft bounce.
    "bounce": lambda e: Kind.SOFT_BOUNCE if e.get("type") == "blocked" else Kind.BOUNCE,
    "dropped": lambda e: Kind.BOUNCE if "bounced" in str(e.get("reason", "")).lower() else Kind.OTHER,
}
SIGNATURE_HEADER = "X-Twilio-Email-Event-Webhook-Signature"
TIMESTAMP_HEADER = "X-Twilio-Email-Event-Webhook-Timestamp"


@dataclass(frozen=True, slots=True)
class Sendgrid(_Base):
    public_key: Any
    kind: str = "sendgrid"

    def precheck(self, headers: Mapping[str, str]) -> None:
        _header(headers, SIGNATURE_HEADER)
        _header(headers, TIMESTAMP_HEADER)

    def verify(self, body: bytes, headers: Mapping[str, str], now: float) -> Verified:
        signature = _header(headers, SIGNATURE_HEADER)
        timestamp = _header(headers, TIMESTAMP_HEADER)
        if not signatures.sendgrid(self.public_key, timestamp, body, signature):
            raise Rejected(401, "the signature does not verify with the public key")
        self._fresh_seconds(timestamp, now, TIMESTAMP_HEADER)
        payload = _json(body)
        if not isinstance(payload, list):
            raise Rejected(400, "the body is not a JSON array of events")
        return Verified([self._event(_obj(e, "an event"), now) for e in payload])

    def _event(self, e: dict[str, Any], now: float) -> ProviderEvent:
        event, kind = event_kind(e, "event", _SENDGRID_KINDS, "an event has no `event`")
        sg_message_id = _str(e.get("sg_message_id"))
        # The SMTP 250 names the X-Message-Id; sg_message_id is that id, a dot, and a suffix.
        upstream = strs(sg_message_id, sg_message_id.split(".", 1)[0] if sg_message_id else None)
        return ProviderEvent(
            source=self.name,
            kind=kind,
            provider_type=event,
            recipient=_str(e.get("email")),
            status=str(e.get("status") or ""),
            at=event_time(e.get("timestamp"), "timestamp", now),
            event_id=_str(e.get("sg_event_id")) or content_id(e),
            match=Match(
                keys=strs(e.get(KEY_FIELD)), message_ids=strs(e.get("smtp-id")), upstream_ids=upstream
            ),
        )
