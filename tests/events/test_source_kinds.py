"""The Kind each source reads an event as, through its provider's table (events/sources/kinds.py),
and the ids a mailed report's events are given: pure, no listener. Requests are signed as the
provider signs them."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from typing import Any

import pytest

from smtpguard.events.reports import read_report
from smtpguard.events.sources import Postmark, Svix
from smtpguard.policy.events import Kind, Malformed, ProviderEvent

NOW = time.time()
PASSWORD = secrets.token_urlsafe(12)
SVIX_SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
RCPT = "someone@example.net"


def postmark(payload: dict[str, Any]) -> list[tuple[Kind, str, str]]:
    source = Postmark("postmark", "primary", 300.0, "hooks", PASSWORD)
    creds = base64.b64encode(f"hooks:{PASSWORD}".encode()).decode()
    verified = source.verify(json.dumps(payload).encode(), {"Authorization": f"Basic {creds}"}, NOW)
    return [(e.kind, e.provider_type, e.status) for e in verified.events]


@pytest.mark.parametrize(
    ("record", "bounce_type", "kind"),
    [
        ("Bounce", "HardBounce", Kind.BOUNCE),
        ("Bounce", "SoftBounce", Kind.SOFT_BOUNCE),
        ("Bounce", None, Kind.SOFT_BOUNCE),
        ("SpamComplaint", None, Kind.COMPLAINT),
        ("Delivery", None, Kind.DELIVERED),
        ("Open", None, Kind.OTHER),
    ],
)
def test_a_postmark_record_type_reads_as_its_kind(record: str, bounce_type: str | None, kind: Kind) -> None:
    payload: dict[str, Any] = {"RecordType": record, "ID": 7, "Email": RCPT}
    if bounce_type is not None:
        payload["Type"] = bounce_type
    provider_type = record if bounce_type is None else f"{record}/{bounce_type}"
    status = (bounce_type or "") if record == "Bounce" else ""
    assert postmark(payload) == [(kind, provider_type, status)]


def test_a_postmark_record_without_a_type_is_malformed() -> None:
    with pytest.raises(Malformed, match="`RecordType` is missing"):
        postmark({"ID": 7, "Email": RCPT})


def svix(payload: dict[str, Any]) -> list[tuple[Kind, str, str]]:
    source = Svix("resend", "primary", 300.0, SVIX_SECRET)
    body, msg_id, timestamp = json.dumps(payload).encode(), "msg_1", str(int(NOW))
    key = base64.b64decode(SVIX_SECRET.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    headers = {
        "svix-id": msg_id,
        "svix-timestamp": timestamp,
        "svix-signature": f"v1,{base64.b64encode(mac).decode()}",
    }
    return [(e.kind, e.provider_type, e.status) for e in source.verify(body, headers, NOW).events]


@pytest.mark.parametrize(
    ("event", "bounce", "kind"),
    [
        ("email.bounced", {"type": "Permanent", "subType": "General"}, Kind.BOUNCE),
        ("email.bounced", {"type": "Transient", "subType": "General"}, Kind.SOFT_BOUNCE),
        ("email.bounced", {"type": "Undetermined"}, Kind.SOFT_BOUNCE),
        ("email.bounced", None, Kind.BOUNCE),
        ("email.complained", None, Kind.COMPLAINT),
        ("email.delivered", None, Kind.DELIVERED),
        ("email.delivery_delayed", None, Kind.DEFERRED),
        ("email.opened", None, Kind.OTHER),
    ],
)
def test_a_resend_event_type_reads_as_its_kind(event: str, bounce: dict[str, str] | None, kind: Kind) -> None:
    data: dict[str, Any] = {"email_id": "e1", "to": [RCPT]}
    if bounce is not None:
        data["bounce"] = bounce
    status = "/".join(v for v in (bounce or {}).values())
    assert svix({"type": event, "data": data}) == [(kind, event, status)]


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"data": {"to": [RCPT]}}, "`type` is missing"),
        ({"data": []}, "`type` is missing"),
        ({"type": "email.bounced", "data": []}, "data is not an object"),
        ({"type": "email.bounced", "data": {"bounce": "Transient"}}, None),
    ],
)
def test_a_resend_event_without_a_type_or_data_is_malformed(
    payload: dict[str, Any], problem: str | None
) -> None:
    if problem is None:
        assert svix(payload) == [(Kind.BOUNCE, "email.bounced", "")]
        return
    with pytest.raises(Malformed, match=problem):
        svix(payload)


def report(report_type: str, part_type: str, fields: str) -> bytes:
    return (
        "From: MAILER-DAEMON@mx.example.net\r\n"
        "MIME-Version: 1.0\r\n"
        f'Content-Type: multipart/report; report-type={report_type}; boundary="b"\r\n'
        "\r\n--b\r\nContent-Type: text/plain\r\n\r\nA report.\r\n"
        f"--b\r\nContent-Type: {part_type}\r\n\r\n{fields}"
        "\r\n--b\r\nContent-Type: text/rfc822-headers\r\n\r\nMessage-ID: <m1@app.example>\r\n\r\n--b--\r\n"
    ).encode()


def digest_of(raw: bytes) -> str:
    return hashlib.sha256(raw.split(b"\r\n\r\n", 1)[-1]).hexdigest()[:32]


def read(raw: bytes) -> tuple[list[ProviderEvent], list[tuple[object, ...]], str]:
    """The report's events, each as (kind, provider_type, recipient, status, event_id), and
    the digest its ids are made of."""
    events = read_report(raw, "mailbox", NOW, 100)
    rows = [(e.kind, e.provider_type, e.recipient, e.status, e.event_id) for e in events]
    return events, rows, digest_of(raw)


def test_a_dsn_names_each_recipient_s_event_by_the_report_and_its_place() -> None:
    raw = report(
        "delivery-status",
        "message/delivery-status",
        "Reporting-MTA: dns; mx.example.net\r\n\r\n"
        f"Final-Recipient: rfc822; {RCPT}\r\nAction: failed\r\nStatus: 5.1.1\r\n\r\n"
        "Final-Recipient: rfc822; other@example.net\r\nAction: delayed\r\nStatus: 4.4.1\r\n\r\n"
        "Final-Recipient: rfc822; third@example.net\r\nStatus: 2.0.0\r\n",
    )
    events, rows, digest = read(raw)
    assert rows == [
        (Kind.BOUNCE, "dsn/failed", RCPT, "5.1.1", f"dsn:{digest}:0"),
        (Kind.DEFERRED, "dsn/delayed", "other@example.net", "4.4.1", f"dsn:{digest}:1"),
        (Kind.OTHER, "dsn/-", "third@example.net", "2.0.0", f"dsn:{digest}:2"),
    ]
    assert {e.match.message_ids for e in events} == {("<m1@app.example>",)}
    assert {(e.source, e.at) for e in events} == {("mailbox", NOW)}


def test_an_arf_report_names_each_recipient_s_event_by_the_report_and_its_place() -> None:
    raw = report(
        "feedback-report",
        "message/feedback-report",
        f"Feedback-Type: abuse\r\nVersion: 1\r\nOriginal-Rcpt-To: {RCPT}\r\n"
        "Original-Rcpt-To: b@example.net\r\n",
    )
    _, rows, digest = read(raw)
    assert rows == [
        (Kind.COMPLAINT, "arf/abuse", RCPT, "abuse", f"arf:{digest}:0"),
        (Kind.COMPLAINT, "arf/abuse", "b@example.net", "abuse", f"arf:{digest}:1"),
    ]
