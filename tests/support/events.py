"""Provider webhooks as each provider sends them: keys made here, requests signed exactly as
the provider documents it, payloads shaped like the documented examples.

Nothing is mocked: the signer of each kind is the provider's algorithm run with a key this
test generated, and the guard verifies it with the public half (or shared secret) it was
configured with.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import NameOID

from smtpguard.events.sources import sns_canonical


@dataclass
class Keys:
    """One set of secrets for every kind, and the config that names them."""

    mailgun: str
    sendgrid_private: ec.EllipticCurvePrivateKey
    svix: str
    postmark: str
    ses_private: rsa.RSAPrivateKey
    ses_cert: Path
    topic: str = "arn:aws:sns:eu-west-1:123456789012:ses-events"

    @classmethod
    def make(cls, tmp: Path) -> Keys:
        ses_private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sns.eu-west-1.amazonaws.com")])
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ses_private.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .sign(ses_private, hashes.SHA256())
        )
        path = tmp / "sns.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(
            mailgun="key-" + secrets.token_hex(16),
            sendgrid_private=ec.generate_private_key(ec.SECP256R1()),
            svix="whsec_" + base64.b64encode(secrets.token_bytes(24)).decode(),
            postmark=secrets.token_urlsafe(18),
            ses_private=ses_private,
            ses_cert=path,
        )

    def sendgrid_public_b64(self) -> str:
        der = self.sendgrid_private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return base64.b64encode(der).decode()

    def env(self) -> dict[str, str]:
        return {
            "T_MAILGUN_KEY": self.mailgun,
            "T_SENDGRID_KEY": self.sendgrid_public_b64(),
            "T_SVIX_SECRET": self.svix,
            "T_POSTMARK_PASSWORD": self.postmark,
        }

    def sources(self, provider: str = "primary") -> dict[str, Any]:
        return {
            "mailgun": {"kind": "mailgun", "provider": provider, "signing_key_env": "T_MAILGUN_KEY"},
            "sendgrid": {"kind": "sendgrid", "provider": provider, "public_key_env": "T_SENDGRID_KEY"},
            "resend": {"kind": "svix", "provider": provider, "secret_env": "T_SVIX_SECRET"},
            "postmark": {
                "kind": "postmark",
                "provider": provider,
                "username": "hooks",
                "password_env": "T_POSTMARK_PASSWORD",
            },
            "ses": {
                "kind": "ses",
                "provider": provider,
                "certificate_file": str(self.ses_cert),
                "topic_arn": self.topic,
            },
        }


@dataclass
class Signed:
    body: bytes
    headers: dict[str, str]


# --- signers: each provider's documented algorithm -------------------------------------------
def mailgun(
    keys: Keys, event_data: dict[str, Any], *, at: float | None = None, key: str | None = None
) -> Signed:
    timestamp = str(int(at if at is not None else time.time()))
    token = secrets.token_hex(25)
    signature = hmac.new(
        (key or keys.mailgun).encode(), (timestamp + token).encode(), hashlib.sha256
    ).hexdigest()
    body = {
        "signature": {"timestamp": timestamp, "token": token, "signature": signature},
        "event-data": event_data,
    }
    return Signed(json.dumps(body).encode(), {"Content-Type": "application/json"})


def sendgrid(
    keys: Keys, events: list[dict[str, Any]], *, at: float | None = None, private: Any = None
) -> Signed:
    timestamp = str(int(at if at is not None else time.time()))
    body = json.dumps(events).encode()
    signer = private or keys.sendgrid_private
    signature = signer.sign(timestamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    return Signed(
        body,
        {
            "Content-Type": "application/json",
            "X-Twilio-Email-Event-Webhook-Signature": base64.b64encode(signature).decode(),
            "X-Twilio-Email-Event-Webhook-Timestamp": timestamp,
        },
    )


def svix(
    keys: Keys, payload: dict[str, Any], *, at: float | None = None, secret: str | None = None
) -> Signed:
    msg_id = "msg_" + secrets.token_hex(12)
    timestamp = str(int(at if at is not None else time.time()))
    body = json.dumps(payload).encode()
    key = base64.b64decode((secret or keys.svix).removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    # Two signatures, as during a secret rotation: the first made with a retired secret.
    header = f"v1,{base64.b64encode(b'x' * 32).decode()} v1,{base64.b64encode(mac).decode()}"
    return Signed(
        body,
        {
            "Content-Type": "application/json",
            "svix-id": msg_id,
            "svix-timestamp": timestamp,
            "svix-signature": header,
        },
    )


def postmark(keys: Keys, payload: dict[str, Any], *, password: str | None = None) -> Signed:
    creds = base64.b64encode(f"hooks:{password or keys.postmark}".encode()).decode()
    return Signed(
        json.dumps(payload).encode(), {"Content-Type": "application/json", "Authorization": f"Basic {creds}"}
    )


def ses(
    keys: Keys,
    message: dict[str, Any] | None,
    *,
    at: float | None = None,
    version: str = "1",
    kind: str = "Notification",
    topic: str | None = None,
    private: Any = None,
    message_id: str | None = None,
    subscribe_url: str = "https://sns.eu-west-1.amazonaws.com/?Action=ConfirmSubscription&Token=x",
) -> Signed:
    when = dt.datetime.fromtimestamp(at if at is not None else time.time(), dt.UTC)
    envelope: dict[str, Any] = {
        "Type": kind,
        "MessageId": message_id or f"{secrets.token_hex(4)}-{secrets.token_hex(2)}-{secrets.token_hex(6)}",
        "TopicArn": topic or keys.topic,
        "Message": json.dumps(message)
        if message is not None
        else "You have chosen to subscribe to the topic.",
        "Timestamp": when.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
        "SignatureVersion": version,
        "SigningCertURL": "https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-0000.pem",
    }
    if kind == "Notification":
        envelope["UnsubscribeURL"] = "https://sns.eu-west-1.amazonaws.com/?Action=Unsubscribe"
    else:
        envelope["Token"] = secrets.token_hex(32)
        envelope["SubscribeURL"] = subscribe_url
    algorithm: hashes.HashAlgorithm = hashes.SHA1() if version == "1" else hashes.SHA256()
    signer = private or keys.ses_private
    signature = signer.sign(sns_canonical(envelope), padding.PKCS1v15(), algorithm)
    envelope["Signature"] = base64.b64encode(signature).decode()
    return Signed(json.dumps(envelope).encode(), {"Content-Type": "text/plain; charset=UTF-8"})


# --- payloads shaped like the providers' documented examples ---------------------------------
def mailgun_event(
    event: str,
    recipient: str,
    message_id: str,
    *,
    severity: str | None = None,
    code: int = 550,
    key: str | None = None,
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": secrets.token_urlsafe(16),
        "timestamp": time.time(),
        "log-level": "error" if event == "failed" else "info",
        "event": event,
        "recipient": recipient,
        "recipient-domain": recipient.split("@")[1],
        "message": {"headers": {"message-id": message_id.strip("<>"), "to": recipient, "subject": "Invoice"}},
        "tags": [],
        "user-variables": {"smtpguard_key": key} if key else {},
    }
    if severity:
        data["severity"] = severity
        data["reason"] = "bounce" if severity == "permanent" else "generic"
        data["delivery-status"] = {
            "code": code,
            "message": "5.1.1 The email account that you tried to reach does not exist",
            "description": "",
            "attempt-no": 1,
        }
    return data


SENDGRID_SUFFIX = "filterdrecv-p3mdw1-756b745b58-kmzbl-18-5F5FC76C-9.0"


def sendgrid_event(
    event: str, email: str, smtp_id: str, *, upstream: str = "", **extra: Any
) -> dict[str, Any]:
    e: dict[str, Any] = {
        "email": email,
        "timestamp": int(time.time()),
        "smtp-id": smtp_id,
        "event": event,
        "category": ["invoice"],
        "sg_event_id": secrets.token_urlsafe(16),
        "sg_message_id": f"{upstream or secrets.token_urlsafe(12)}.{SENDGRID_SUFFIX}",
    }
    if event == "bounce":
        e.update({"reason": "500 unknown recipient", "status": "5.0.0", "type": "bounce"})
    e.update(extra)
    return e


def resend_event(
    kind: str, to: str, email_id: str, *, headers: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
        "email_id": email_id,
        "from": "Acme <billing@acme.example>",
        "to": [to],
        "subject": "Invoice",
    }
    if headers is not None:
        data["headers"] = headers
    if kind == "email.bounced":
        data["bounce"] = {
            "message": "The recipient's email address does not exist.",
            "subType": "General",
            "type": "Permanent",
        }
    return {"type": kind, "created_at": dt.datetime.now(dt.UTC).isoformat(), "data": data}


def postmark_bounce(
    email: str, message_id: str, *, kind: str = "HardBounce", record: str = "Bounce"
) -> dict[str, Any]:
    return {
        "RecordType": record,
        "MessageStream": "outbound",
        "ID": secrets.randbelow(10**10),
        "Type": kind,
        "TypeCode": 1 if kind == "HardBounce" else 4096,
        "Name": "Hard bounce",
        "Tag": "invoice",
        "MessageID": message_id,
        "Metadata": {},
        "ServerID": 23,
        "Description": "The server was unable to deliver your message (ex: unknown user, mailbox not found).",
        "Details": "smtp;550 5.1.1 The email account that you tried to reach does not exist.",
        "Email": email,
        "From": "billing@acme.example",
        "BouncedAt": dt.datetime.now(dt.UTC).isoformat(),
        "Inactive": True,
        "CanActivate": True,
        "Subject": "Invoice",
    }


def postmark_record(record: str, email: str, message_id: str) -> dict[str, Any]:
    if record == "SpamComplaint":
        return {**postmark_bounce(email, message_id, kind="SpamComplaint"), "RecordType": "SpamComplaint"}
    return {
        "RecordType": "Delivery",
        "ServerID": 23,
        "MessageStream": "outbound",
        "MessageID": message_id,
        "Recipient": email,
        "Tag": "invoice",
        "DeliveredAt": dt.datetime.now(dt.UTC).isoformat(),
        "Details": "Test delivery webhook details",
        "Metadata": {},
    }


def ses_message(
    kind: str, recipient: str, message_id: str, ses_id: str, *, bounce_type: str = "Permanent"
) -> dict[str, Any]:
    mail = {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(),
        "source": "billing@acme.example",
        "messageId": ses_id,
        "destination": [recipient],
        "headersTruncated": False,
        "commonHeaders": {
            "from": ["billing@acme.example"],
            "to": [recipient],
            "messageId": message_id,
            "subject": "Invoice",
        },
    }
    m: dict[str, Any] = {"notificationType": kind, "mail": mail}
    if kind == "Bounce":
        m["bounce"] = {
            "bounceType": bounce_type,
            "bounceSubType": "General",
            "bouncedRecipients": [
                {
                    "emailAddress": recipient,
                    "action": "failed",
                    "status": "5.1.1",
                    "diagnosticCode": "smtp; 550 5.1.1 user unknown",
                }
            ],
            "timestamp": dt.datetime.now(dt.UTC).isoformat(),
            "feedbackId": "0100" + secrets.token_hex(8),
        }
    elif kind == "Complaint":
        m["complaint"] = {
            "complainedRecipients": [{"emailAddress": recipient}],
            "timestamp": dt.datetime.now(dt.UTC).isoformat(),
            "feedbackId": "0100" + secrets.token_hex(8),
            "complaintFeedbackType": "abuse",
        }
    elif kind == "Delivery":
        m["delivery"] = {
            "timestamp": dt.datetime.now(dt.UTC).isoformat(),
            "recipients": [recipient],
            "smtpResponse": "250 ok",
        }
    return m


async def post(
    port: int, source: str, signed: Signed, *, raw: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{port}/events/{source}",
            data=raw if raw is not None else signed.body,
            headers=signed.headers,
        ) as resp,
    ):
        try:
            doc = await resp.json(content_type=None)
        except ValueError:
            doc = {}
        return resp.status, doc
