"""Each source kind of §13: verify a request, then read its events into ProviderEvents.

No I/O here (the configured secrets are read by `build_sources`, once, at start). A request
gets exactly one verdict: `Verified` (its events, maybe none), or `Rejected` with the HTTP
status of §13 — 401 signature or auth missing, wrong or stale; 403 another SNS topic; 400
not what the source sends. Payload shapes follow each provider's documented webhook
bodies; the tests' fixtures are written from the same documents.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from smtpguard.config import (
    ConfigError,
    EventsConfig,
    MailgunSource,
    PostmarkSource,
    SendgridSource,
    SesSource,
    SvixSource,
    read_secret,
)
from smtpguard.events import signatures
from smtpguard.events.times import epoch, event_time
from smtpguard.policy.events import ID_HEADER, KEY_FIELD, Kind, Malformed, Match, ProviderEvent, content_id


class Rejected(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Nonce:
    name: str
    digest: str
    until: float


@dataclass(frozen=True, slots=True)
class Verified:
    events: list[ProviderEvent]
    notice: str | None = None
    """Something the operator must act on (an SNS subscription to confirm by hand)."""
    nonce: Nonce | None = None
    """To be remembered by the store before the events apply (Store.remember_nonce)."""


class Source(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def provider(self) -> str:
        """The provider whose records this source's events may match."""

    @property
    def kind(self) -> str: ...

    def precheck(self, headers: Mapping[str, str]) -> None:
        """What can be refused before the body is read (missing signature headers, wrong
        Basic credentials): raises Rejected."""

    def verify(self, body: bytes, headers: Mapping[str, str], now: float) -> Verified: ...


@dataclass(frozen=True, slots=True)
class _Base:
    name: str
    provider: str
    tolerance: float

    def precheck(self, headers: Mapping[str, str]) -> None:
        return None

    def _fresh(self, timestamp: float, now: float) -> None:
        if not math.isfinite(timestamp) or abs(now - timestamp) > self.tolerance:
            raise Rejected(401, "timestamp outside the tolerance (a replayed or delayed request)")


# --- small readers ---------------------------------------------------------------------------
def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        # RecursionError: nesting deeper than the parser's stack (`[[[[…`), before any check.
        raise Rejected(400, f"the body is not JSON: {type(e).__name__}") from None


def _json_object(body: bytes) -> dict[str, Any]:
    payload = _json(body)
    if not isinstance(payload, dict):
        raise Rejected(400, "the body is not a JSON object")
    return payload


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Malformed(f"{what} is not an object")
    return value


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _strs(*values: Any) -> tuple[str, ...]:
    return tuple(v for v in values if isinstance(v, str) and v)


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if not value:
        raise Rejected(401, f"the {name} header is missing")
    return value


def _named_headers(items: Any) -> dict[str, str]:
    """[{name, value}, …] (SES mail.headers, Resend data.headers) as a lower-cased dict."""
    out: dict[str, str] = {}
    if isinstance(items, list):
        for item in items:
            if (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("value"), str)
            ):
                out.setdefault(item["name"].lower(), item["value"])
    elif isinstance(items, dict):
        out = {str(k).lower(): v for k, v in items.items() if isinstance(v, str)}
    return out


# --- Mailgun ---------------------------------------------------------------------------------
_MAILGUN_KINDS = {"complained": Kind.COMPLAINT, "unsubscribed": Kind.UNSUBSCRIBE, "delivered": Kind.DELIVERED}


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
        try:
            self._fresh(float(timestamp), now)
        except ValueError:
            raise Rejected(401, "signature.timestamp is not a number") from None
        data = _obj(payload.get("event-data"), "event-data")
        # The signature covers timestamp and token, not the body: the token seen again with
        # another body is a captured request replayed with its events changed. The store
        # remembers it fleet-wide for as long as its timestamp is fresh.
        nonce = Nonce(
            f"mailgun:{self.name}:{token}",
            hashlib.sha256(body).hexdigest(),
            float(timestamp) + self.tolerance,
        )
        return Verified([self._event(data, now)], nonce=nonce)

    def _event(self, data: dict[str, Any], now: float) -> ProviderEvent:
        event = _str(data.get("event"))
        if event is None:
            raise Malformed("event-data.event is missing")
        if event == "failed":
            kind = Kind.BOUNCE if data.get("severity") == "permanent" else Kind.SOFT_BOUNCE
        else:
            kind = _MAILGUN_KINDS.get(event, Kind.OTHER)
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
            match=Match(
                keys=_strs(variables.get(KEY_FIELD)), message_ids=_strs(msg_headers.get("message-id"))
            ),
        )


# --- SendGrid --------------------------------------------------------------------------------
_SENDGRID_KINDS = {
    "spamreport": Kind.COMPLAINT,
    "unsubscribe": Kind.UNSUBSCRIBE,
    "group_unsubscribe": Kind.UNSUBSCRIBE,
    "delivered": Kind.DELIVERED,
    "deferred": Kind.DEFERRED,
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
        try:
            self._fresh(float(timestamp), now)
        except ValueError:
            raise Rejected(401, f"{TIMESTAMP_HEADER} is not a number") from None
        payload = _json(body)
        if not isinstance(payload, list):
            raise Rejected(400, "the body is not a JSON array of events")
        return Verified([self._event(_obj(e, "an event"), now) for e in payload])

    def _event(self, e: dict[str, Any], now: float) -> ProviderEvent:
        event = _str(e.get("event"))
        if event is None:
            raise Malformed("an event has no `event`")
        if event == "bounce":
            # `blocked` is the receiver refusing this message (content, reputation), not a
            # dead address: history only, like a soft bounce.
            kind = Kind.SOFT_BOUNCE if e.get("type") == "blocked" else Kind.BOUNCE
        elif event == "dropped":
            kind = Kind.BOUNCE if "bounced" in str(e.get("reason", "")).lower() else Kind.OTHER
        else:
            kind = _SENDGRID_KINDS.get(event, Kind.OTHER)
        sg_message_id = _str(e.get("sg_message_id"))
        # The SMTP 250 names the X-Message-Id; sg_message_id is that id, a dot, and a suffix.
        upstream = _strs(sg_message_id, sg_message_id.split(".", 1)[0] if sg_message_id else None)
        return ProviderEvent(
            source=self.name,
            kind=kind,
            provider_type=event,
            recipient=_str(e.get("email")),
            status=str(e.get("status") or ""),
            at=event_time(e.get("timestamp"), "timestamp", now),
            event_id=_str(e.get("sg_event_id")) or content_id(e),
            match=Match(
                keys=_strs(e.get(KEY_FIELD)), message_ids=_strs(e.get("smtp-id")), upstream_ids=upstream
            ),
        )


# --- Svix (Resend and other providers delivering through Svix) -------------------------------
_RESEND_KINDS = {
    "email.bounced": Kind.BOUNCE,
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
        try:
            self._fresh(float(timestamp), now)
        except ValueError:
            raise Rejected(401, "svix-timestamp is not a number") from None
        payload = _json_object(body)
        return Verified(self._events(payload, msg_id, now))

    def _events(self, payload: dict[str, Any], msg_id: str, now: float) -> list[ProviderEvent]:
        event = _str(payload.get("type"))
        if event is None:
            raise Malformed("`type` is missing")
        data = _obj(payload.get("data"), "data")
        kind = _RESEND_KINDS.get(event, Kind.OTHER)
        bounce = data.get("bounce") if isinstance(data.get("bounce"), dict) else {}
        assert isinstance(bounce, dict)
        if kind is Kind.BOUNCE and bounce.get("type") in ("Transient", "Undetermined"):
            kind = Kind.SOFT_BOUNCE
        status = "/".join(_strs(bounce.get("type"), bounce.get("subType")))
        headers = _named_headers(data.get("headers"))
        match = Match(
            sg_ids=_strs(headers.get(ID_HEADER.lower())),
            message_ids=_strs(headers.get("message-id")),
            upstream_ids=_strs(data.get("email_id")),
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


# --- Postmark --------------------------------------------------------------------------------
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
        record_type = _str(p.get("RecordType"))
        if record_type is None:
            raise Malformed("`RecordType` is missing")
        bounce_type = str(p.get("Type") or "")
        if record_type == "Bounce":
            kind = Kind.BOUNCE if bounce_type == "HardBounce" else Kind.SOFT_BOUNCE
        elif record_type == "SpamComplaint":
            kind = Kind.COMPLAINT
        elif record_type == "Delivery":
            kind = Kind.DELIVERED
        else:
            kind = Kind.OTHER
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
                keys=_strs(metadata.get(KEY_FIELD)),
                upstream_ids=_strs(p.get("MessageID")),
            ),
        )


# --- Amazon SES through SNS ------------------------------------------------------------------
_SES_SECTIONS = {
    "Bounce": "bounce",
    "Complaint": "complaint",
    "Delivery": "delivery",
    "DeliveryDelay": "deliveryDelay",
}
"""Where each SES event keeps its own time (the field a refused time is named by)."""
_SNS_SIGNED = {
    "Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    "SubscriptionConfirmation": (
        "Message",
        "MessageId",
        "SubscribeURL",
        "Timestamp",
        "Token",
        "TopicArn",
        "Type",
    ),
    "UnsubscribeConfirmation": (
        "Message",
        "MessageId",
        "SubscribeURL",
        "Timestamp",
        "Token",
        "TopicArn",
        "Type",
    ),
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
            sg_ids=_strs(headers.get(ID_HEADER.lower())),
            message_ids=_strs(common.get("messageId"), headers.get("message-id")),
            upstream_ids=_strs(mail.get("messageId")),
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


# --- building them from the config -----------------------------------------------------------
@dataclass
class Sources:
    by_name: dict[str, Source] = field(default_factory=dict)

    def get(self, name: str) -> Source | None:
        return self.by_name.get(name)


def build_sources(events: EventsConfig, read: Callable[[Path], bytes] = Path.read_bytes) -> Sources:
    """Every source with its secret read now, so a missing one fails at start, not at the
    first webhook. Problems name the source's config path."""
    out = Sources()
    problems: list[str] = []
    for name, cfg in events.sources.items():
        where = f"events.sources.{name}"
        try:
            out.by_name[name] = _build(name, cfg, events.tolerance, where, read)
        except ConfigError as e:
            problems.extend(e.problems)
        except signatures.KeyProblem as e:
            problems.append(f"{where}: {e}")
    if problems:
        raise ConfigError(problems)
    return out


def _build(
    name: str,
    cfg: MailgunSource | SendgridSource | SvixSource | PostmarkSource | SesSource,
    tolerance: float,
    where: str,
    read: Callable[[Path], bytes],
) -> Source:
    def secret(env: str | None, file: Path | None) -> str:
        value = read_secret(env, file, where)
        assert value is not None  # the config demands one of the two
        return value

    if isinstance(cfg, MailgunSource):
        signing_key = secret(cfg.signing_key_env, cfg.signing_key_file)
        return Mailgun(name, cfg.provider, tolerance, signing_key)
    if isinstance(cfg, SendgridSource):
        key = signatures.sendgrid_key(secret(cfg.public_key_env, cfg.public_key_file))
        return Sendgrid(name, cfg.provider, tolerance, key)
    if isinstance(cfg, SvixSource):
        svix_secret = secret(cfg.secret_env, cfg.secret_file)
        signatures.svix_key(svix_secret)  # a secret that cannot verify anything is a config error
        return Svix(name, cfg.provider, tolerance, svix_secret)
    if isinstance(cfg, PostmarkSource):
        password = secret(cfg.password_env, cfg.password_file)
        return Postmark(name, cfg.provider, tolerance, cfg.username, password)
    try:
        pem = read(cfg.certificate_file)
    except OSError as e:
        raise ConfigError(
            [f"{where}.certificate_file: cannot read {cfg.certificate_file}: {e.strerror}"]
        ) from None
    return Ses(name, cfg.provider, tolerance, signatures.sns_certificates(pem), cfg.topic_arn)
