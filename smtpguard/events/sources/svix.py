"""Svix's signed webhooks (Resend and other providers delivering through Svix): svix-id,
svix-timestamp and svix-signature headers, HMAC-SHA256 with the whsec_ secret; one email
event a request, read as one event per recipient it names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smtpguard.events import signatures
from smtpguard.events.sources.base import (
    Rejected,
    Verified,
    _Base,
    _header,
    _json_object,
    _named_headers,
    _obj,
)
from smtpguard.events.sources.kinds import Kinds, event_kind
from smtpguard.events.times import event_time
from smtpguard.policy.events import ID_HEADER, Kind, Match, ProviderEvent, strs


def _resend_bounce(payload: dict[str, Any]) -> Kind:
    """Resend's data.bounce.type: a Transient or Undetermined bounce is a soft one."""
    data = payload.get("data")
    bounce = data.get("bounce") if isinstance(data, dict) else None
    soft = isinstance(bounce, dict) and bounce.get("type") in ("Transient", "Undetermined")
    return Kind.SOFT_BOUNCE if soft else Kind.BOUNCE


_RESEND_KINDS: Kinds = {
    "email.bounced": _resend_bounce,
    "email.complained": Kind.COMPLAINT,
    "email.delivered": Kind.DELIVERED,
    "email.delivery_delayed": Kind.DEFERRED,
}


@dataclass(frozen=True, slots=True)
class Svix(_Base):
    secret: str
    kind: str = "svix"

    def precheck(self, headers: Mapping[str, str]) -> None:
        for name in ("svix-id", "svix-timestamp", "svix-signature"):
            _header(headers, name)

    def verify(self, body: bytes, headers: Mapping[str, str], now: float) -> Verified:
        msg_id = _header(headers, "svix-id")
        timestamp = _header(headers, "svix-timestamp")
        if not signatures.svix(self.secret, msg_id, timestamp, body, _header(headers, "svix-signature")):
            raise Rejected(401, "no svix-signature verifies with the secret")
        self._fresh_seconds(timestamp, now, "svix-timestamp")
        payload = _json_object(body)
        return Verified(self._events(payload, msg_id, now))

    def _events(self, payload: dict[str, Any], msg_id: str, now: float) -> list[ProviderEvent]:
        event, kind = event_kind(payload, "type", _RESEND_KINDS, "`type` is missing")
        data = _obj(payload.get("data"), "data")
        bounce = data.get("bounce") if isinstance(data.get("bounce"), dict) else {}
        assert isinstance(bounce, dict)
        status = "/".join(strs(bounce.get("type"), bounce.get("subType")))
        headers = _named_headers(data.get("headers"))
        match = Match(
            sg_ids=strs(headers.get(ID_HEADER.lower())),
            message_ids=strs(headers.get("message-id")),
            upstream_ids=strs(data.get("email_id")),
        )
        to = data.get("to")
        recipients: list[str | None] = [r for r in to if isinstance(r, str)] if isinstance(to, list) else []
        if isinstance(to, str):
            recipients = [to]
        if kind in (Kind.BOUNCE, Kind.COMPLAINT) and len(recipients) > 1:
            # The event names the email, not which of its recipients bounced or complained:
            # suppressing all of them would punish the ones who did not.
            kind = Kind.OTHER
        at = event_time(payload.get("created_at") or data.get("created_at"), "created_at", now)
        return [
            ProviderEvent(
                self.name,
                kind,
                event,
                rcpt,
                status,
                at,
                msg_id if len(recipients) <= 1 else f"{msg_id}:{i}",
                match,
            )
            for i, rcpt in enumerate(recipients or [None])
        ]
