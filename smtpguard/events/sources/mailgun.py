"""Mailgun's webhooks: `signature` {timestamp, token, signature} in the JSON body, HMAC-SHA256
with the webhook signing key; one event a request, in `event-data`."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smtpguard.events import signatures
from smtpguard.events.sources.base import Nonce, Rejected, Verified, _Base, _json_object, _obj, _str
from smtpguard.events.sources.kinds import Kinds, event_kind
from smtpguard.events.times import event_time
from smtpguard.policy.events import KEY_FIELD, Kind, Match, ProviderEvent, content_id, strs

_MAILGUN_KINDS: Kinds = {
    "complained": Kind.COMPLAINT,
    "unsubscribed": Kind.UNSUBSCRIBE,
    "delivered": Kind.DELIVERED,
    "failed": lambda data: Kind.BOUNCE if data.get("severity") == "permanent" else Kind.SOFT_BOUNCE,
}


@dataclass(frozen=True, slots=True)
class Mailgun(_Base):
    signing_key: str
    kind: str = "mailgun"

    def verify(self, body: bytes, headers: Mapping[str, str], now: float) -> Verified:
        payload = _json_object(body)
        sig = payload.get("signature")
        if not isinstance(sig, dict) or not all(
            isinstance(sig.get(k), str | int) for k in ("timestamp", "token", "signature")
        ):
            raise Rejected(401, "signature.timestamp, .token or .signature is missing")
        timestamp, token, signature = str(sig["timestamp"]), str(sig["token"]), str(sig["signature"])
        if not signatures.mailgun(self.signing_key, timestamp, token, signature):
            raise Rejected(401, "the signature does not verify with the signing key")
        at = self._fresh_seconds(timestamp, now, "signature.timestamp")
        data = _obj(payload.get("event-data"), "event-data")
        # The signature covers timestamp and token, not the body: the token seen again with
        # another body is a captured request replayed with its events changed. The store
        # remembers it fleet-wide for as long as its timestamp is fresh.
        nonce = Nonce(
            f"mailgun:{self.name}:{token}",
            hashlib.sha256(body).hexdigest(),
            at + self.tolerance,
        )
        return Verified([self._event(data, now)], nonce=nonce)

    def _event(self, data: dict[str, Any], now: float) -> ProviderEvent:
        event, kind = event_kind(data, "event", _MAILGUN_KINDS, "event-data.event is missing")
        status = data.get("delivery-status")
        code = ""
        if isinstance(status, dict):
            enhanced = status.get("enhanced-code")
            code = str(enhanced or status.get("code") or "")
        message = data.get("message") if isinstance(data.get("message"), dict) else {}
        assert isinstance(message, dict)
        msg_headers = message.get("headers") if isinstance(message.get("headers"), dict) else {}
        assert isinstance(msg_headers, dict)
        variables = data.get("user-variables") if isinstance(data.get("user-variables"), dict) else {}
        assert isinstance(variables, dict)
        return ProviderEvent(
            source=self.name,
            kind=kind,
            provider_type=event if event != "failed" else f"failed/{data.get('severity', '')}",
            recipient=_str(data.get("recipient")),
            status=code,
            at=event_time(data.get("timestamp"), "event-data.timestamp", now),
            event_id=_str(data.get("id")) or content_id(data),
            match=Match(keys=strs(variables.get(KEY_FIELD)), message_ids=strs(msg_headers.get("message-id"))),
        )
