"""DSNs (RFC 3464) and ARF complaint reports (RFC 5965) mailed to `events.mailbox` have the
effects of §13, sent by a real SMTP client to the guard's mailbox listener."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiosmtplib
import pytest

from smtpguard.server import Server
from tests.events.test_events import RCPT, sent, suppressed
from tests.support import Upstream, base_config, running_guard

MAILBOX = "bounces@guard.test"


def dsn(original_headers: str, action: str = "failed", status: str = "5.1.1", to: str = RCPT) -> bytes:
    """A DSN as Postfix writes one: text, delivery-status, the returned headers."""
    boundary = "dsn-boundary-1"
    return (
        "From: MAILER-DAEMON@mx.example.net\r\n"
        f"To: {MAILBOX}\r\n"
        "Subject: Undelivered Mail Returned to Sender\r\n"
        "MIME-Version: 1.0\r\n"
        f'Content-Type: multipart/report; report-type=delivery-status; boundary="{boundary}"\r\n'
        "\r\n"
        f"--{boundary}\r\n"
        "Content-Type: text/plain\r\n\r\n"
        "I'm sorry to have to inform you that your message could not be delivered.\r\n"
        f"--{boundary}\r\n"
        "Content-Type: message/delivery-status\r\n\r\n"
        "Reporting-MTA: dns; mx.example.net\r\n"
        "Arrival-Date: Tue,  1 Dec 2026 12:00:00 +0000 (UTC)\r\n"
        "\r\n"
        f"Final-Recipient: rfc822; {to}\r\n"
        f"Original-Recipient: rfc822;{to}\r\n"
        f"Action: {action}\r\n"
        f"Status: {status}\r\n"
        "Diagnostic-Code: smtp; 550 5.1.1 <gone@example.net>: Recipient address rejected\r\n"
        f"\r\n--{boundary}\r\n"
        "Content-Type: text/rfc822-headers\r\n\r\n"
        f"{original_headers}\r\n"
        f"--{boundary}--\r\n"
    ).encode()


def arf(original_headers: str, feedback: str = "abuse") -> bytes:
    boundary = "arf-boundary-1"
    return (
        "From: feedback@isp.example\r\n"
        f"To: {MAILBOX}\r\n"
        "Subject: FW: Invoice\r\n"
        "MIME-Version: 1.0\r\n"
        f'Content-Type: multipart/report; report-type=feedback-report; boundary="{boundary}"\r\n'
        "\r\n"
        f"--{boundary}\r\n"
        "Content-Type: text/plain\r\n\r\n"
        "This is an email abuse report.\r\n"
        f"--{boundary}\r\n"
        "Content-Type: message/feedback-report\r\n\r\n"
        f"Feedback-Type: {feedback}\r\n"
        "User-Agent: SomeGenerator/1.0\r\n"
        "Version: 1\r\n"
        f"Original-Rcpt-To: {RCPT}\r\n"
        f"\r\n--{boundary}\r\n"
        "Content-Type: text/rfc822-headers\r\n\r\n"
        f"{original_headers}\r\n"
        f"--{boundary}--\r\n"
    ).encode()


VERP_DOMAIN = "verp.guard.test"
VERP_SECRET_ENV = "SMTPGUARD_TEST_VERP_SECRET"


def mailbox_config(verp: bool = True) -> dict[str, Any]:
    mailbox: dict[str, Any] = {"listen": "127.0.0.1:0", "address": MAILBOX, "provider": "primary"}
    if verp:
        mailbox |= {"domain": VERP_DOMAIN, "secret_env": VERP_SECRET_ENV}
    return mailbox


@pytest.fixture(autouse=True)
def verp_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    secret = "verp-test-secret-0123456789"
    monkeypatch.setenv(VERP_SECRET_ENV, secret)
    return secret


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream) -> Any:
    cfg = base_config(tmp, upstream.port, events={"mailbox": mailbox_config()})
    async with running_guard(cfg) as server:
        yield server


def bounce_address(upstream: Upstream) -> str:
    """The envelope sender the upstream saw last: where a genuine report goes back to."""
    sender = upstream.received[-1].mail_from
    assert sender.startswith("b+") and sender.endswith("@" + VERP_DOMAIN), sender
    return sender


def mailbox_port(guard: Server) -> int:
    assert guard.mailbox is not None
    return guard.mailbox.port


async def deliver(guard: Server, raw: bytes, rcpt: str = MAILBOX) -> tuple[int, str]:
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=mailbox_port(guard), start_tls=False)
    await client.connect()
    try:
        _, text = await client.sendmail("MAILER-DAEMON@mx.example.net", [rcpt], raw)
        return 250, text
    except aiosmtplib.SMTPRecipientsRefused as e:
        return e.recipients[0].code, e.recipients[0].message
    except aiosmtplib.SMTPResponseException as e:
        return e.code, e.message
    finally:
        await client.quit()


async def test_a_dsn_for_a_relayed_message_suppresses_the_recipient(
    guard: Server, upstream: Upstream
) -> None:
    message_id, _ = await sent(guard, upstream, "invoice:1")
    headers = upstream.received[0].content.split(b"\r\n\r\n", 1)[0].decode()
    bounces = bounce_address(upstream)
    assert (await deliver(guard, dsn(headers), bounces))[0] == 250
    assert await suppressed(guard, "acme") == {RCPT: "bounce 5.1.1 via mailbox"}
    assert guard.store is not None
    (event,) = await guard.store.provider_events("acme", "invoice:1")
    assert (event.source, event.type, event.provider_type, event.status) == (
        "mailbox",
        "bounce",
        "dsn/failed",
        "5.1.1",
    )
    assert message_id in headers
    # The same report delivered again (an MTA retrying after a lost 250) changes nothing.
    assert (await deliver(guard, dsn(headers), bounces))[0] == 250
    assert len(await guard.store.provider_events("acme", "invoice:1")) == 1


@pytest.mark.parametrize(
    ("action", "status", "meaning"),
    [
        ("delayed", "4.4.1", "deferred"),
        ("failed", "4.2.2", "soft_bounce"),
        ("delivered", "2.0.0", "delivered"),
    ],
)
async def test_other_dsn_actions_join_the_history_only(
    action: str, status: str, meaning: str, guard: Server, upstream: Upstream
) -> None:
    await sent(guard, upstream, "invoice:1")
    headers = upstream.received[0].content.split(b"\r\n\r\n", 1)[0].decode()
    assert (await deliver(guard, dsn(headers, action, status), bounce_address(upstream)))[0] == 250
    assert await suppressed(guard, "acme") == {}
    assert guard.store is not None
    assert [e.type for e in await guard.store.provider_events("acme", "invoice:1")] == [meaning]


async def test_an_arf_abuse_report_is_a_complaint(guard: Server, upstream: Upstream) -> None:
    await sent(guard, upstream, "newsletter:1")
    headers = upstream.received[0].content.split(b"\r\n\r\n", 1)[0].decode()
    assert (await deliver(guard, arf(headers), bounce_address(upstream)))[0] == 250
    assert await suppressed(guard, "acme") == {RCPT: "complaint via mailbox"}


async def test_an_arf_not_spam_report_is_history_only(guard: Server, upstream: Upstream) -> None:
    await sent(guard, upstream, "newsletter:1")
    headers = upstream.received[0].content.split(b"\r\n\r\n", 1)[0].decode()
    assert (await deliver(guard, arf(headers, feedback="not-spam"), bounce_address(upstream)))[0] == 250
    assert await suppressed(guard, "acme") == {}


async def test_the_mailbox_takes_one_address_and_relays_nothing(guard: Server, upstream: Upstream) -> None:
    code, text = await deliver(guard, b"Subject: hi\r\n\r\nrelay me\r\n", rcpt="someone@example.com")
    assert code == 550 and "5.1.1" in text
    # Not a report: accepted so that no bounce of a bounce is made, nothing applied or relayed.
    assert (await deliver(guard, b"Subject: hi\r\n\r\njust mail\r\n"))[0] == 250
    assert upstream.received == []
    metrics = guard.metrics.render().decode()
    assert 'smtpguard_provider_events_total{outcome="not_a_report",source="mailbox",type="-"} 1.0' in metrics


async def test_a_report_about_a_message_smtpguard_did_not_send_changes_nothing(
    guard: Server, upstream: Upstream
) -> None:
    await sent(guard, upstream, "invoice:1")
    headers = "From: billing@acme.example\r\nMessage-ID: <somebody-else@elsewhere>\r\nSubject: x"
    assert (await deliver(guard, dsn(headers)))[0] == 250
    assert await suppressed(guard, "acme") == {}
    assert guard.store is not None and await guard.store.provider_events("acme", "invoice:1") == []


async def test_a_forged_report_for_an_address_the_message_never_went_to_suppresses_nothing(
    guard: Server, upstream: Upstream
) -> None:
    await sent(guard, upstream, "invoice:1")
    headers = upstream.received[0].content.split(b"\r\n\r\n", 1)[0].decode()
    bounces = bounce_address(upstream)
    assert (await deliver(guard, dsn(headers, to="ceo@acme-customer.example"), bounces))[0] == 250
    assert (await deliver(guard, dsn(headers, to="<>"), bounces))[0] == 250
    assert await suppressed(guard, "acme") == {}
    assert guard.store is not None
    effects = [(e.recipient, e.effect) for e in await guard.store.provider_events("acme", "invoice:1")]
    # At a token that verifies, but not one of the message's recipients: unverified.
    assert effects == [("ceo@acme-customer.example", "unverified"), (None, "history")]
