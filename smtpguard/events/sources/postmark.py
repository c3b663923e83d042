"""Postmark's webhooks: HTTP Basic credentials, since Postmark signs nothing; one record a
request, its kind in `RecordType`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smtpguard.events import signatures
from smtpguard.events.sources.base import Rejected, Verified, _Base, _header, _json_object, _str
from smtpguard.events.sources.kinds import Kinds, event_kind
from smtpguard.events.times import event_time
from smtpguard.policy.events import KEY_FIELD, Kind, Match, ProviderEvent, content_id, strs

_POSTMARK_KINDS: Kinds = {
    "Bounce": lambda p: Kind.BOUNCE if p.get("Type") == "HardBounce" else Kind.SOFT_BOUNCE,
    "SpamComplaint": Kind.COMPLAINT,
    "Delivery": Kind.DELIVERED,
}
_POSTMARK_TIMES = ("BouncedAt", "DeliveredAt", "ReceivedAt", "ChangedAt")


@dataclass(frozen=True, slots=True)
class Postmark(_Base):
    username: str
    password: str
    kind: str = "postmark"

    def precheck(self, headers: Mapping[str, str]) -> None:
        if not signatures.basic_auth(_header(headers, "Authorization"), self.username, self.password):
            raise Rejected(401, "HTTP Basic credentials are wrong")

    def verify(self, body: bytes, headers: Mapping[str, str], now: float) -> Verified:
        self.precheck(headers)
        payload = _json_object(body)
        return Verified([self._event(payload, now)])

    def _event(self, p: dict[str, Any], now: float) -> ProviderEvent:
        record_type, kind = event_kind(p, "RecordType", _POSTMARK_KINDS, "`RecordType` is missing")
        bounce_type = str(p.get("Type") or "")
        metadata = p.get("Metadata") if isinstance(p.get("Metadata"), dict) else {}
        assert isinstance(metadata, dict)
        stamp = next((f for f in _POSTMARK_TIMES if p.get(f)), "BouncedAt")
        event_id = p.get("ID")
        return ProviderEvent(
            source=self.name,
            kind=kind,
            provider_type=record_type if not bounce_type else f"{record_type}/{bounce_type}",
            recipient=_str(p.get("Email")) or _str(p.get("Recipient")),
            status=bounce_type if record_type == "Bounce" else "",
            at=event_time(p.get(stamp), stamp, now),
            event_id=f"{record_type}:{event_id}"
            if isinstance(event_id, int | str) and event_id != ""
            else content_id(p),
            match=Match(
                # Only the spelling smtpguard writes: a look-alike is the client's (§18).
                keys=strs(metadata.get(KEY_FIELD)),
                upstream_ids=strs(p.get("MessageID")),
            ),
        )
