"""A look at the log that could not read everything the search found proves no absence and
no refusal: the entry left unread may be the message's acceptance. Before, each client read
a bounded number of pages (Mailgun 10 of 300, Postmark 10 of 500) or details (SendGrid 3)
and judged what it had read as if it were the whole log: a message whose Message-ID an
application reuses, or a SendGrid message to several recipients, came out `not accepted`
(sent again) or `refused` (failed, so the application sends it another way)."""

from __future__ import annotations

from typing import cast

import pytest

from smtpguard.config.verdicts import VerdictsConfig
from smtpguard.policy.ledger import Record
from smtpguard.policy.verdicts import Attempt, VerdictKind
from smtpguard.verdicts.ask import ask
from smtpguard.verdicts.http import ApiTruncated
from smtpguard.verdicts.mailgun import MailgunLog
from smtpguard.verdicts.sendgrid import SendgridLog
from tests.support.provider_api_fakes import FakeMailgun, FakeSendgrid
from tests.verdicts.test_verdict_clients import FAST, KEY, Now, judge

ABSENT = 1800.0
RECORD = cast(Record, None)
"""ask() only hands the record back in what it found."""


async def test_mailgun_a_reused_message_id_past_ten_pages_is_no_absence(
    mailgun: FakeMailgun, now: Now
) -> None:
    t = now.t
    # An application that writes one Message-ID for every message: 3,000 of others' within
    # the window, logged before the attempt's own acceptance (ascending: the last page).
    for i in range(3000):
        mailgun.add("accepted", t - 500 + i * 0.1, message_id="<fixed@acme.example>", tag=f"acme:o{i}")
    mailgun.add("accepted", t + 5, message_id="<fixed@acme.example>", tag="acme:1")
    mailgun.add("accepted", t + 900, message_id="<later@acme.example>", tag="acme:2")  # the proof
    attempt = Attempt("primary", t, "acme:1", "<fixed@acme.example>")
    async with MailgunLog(
        provider="primary", base_url=mailgun.base_url, key=KEY, domain=mailgun.domain, wall=now, retry=FAST
    ) as client:
        v = await judge_safely(client, attempt, t + ABSENT + 10)
        assert v is not VerdictKind.NOT_ACCEPTED
        with pytest.raises(ApiTruncated):
            await client.entries(attempt)
    assert v is VerdictKind.NONE_YET


async def test_mailgun_an_acceptance_read_before_the_pages_ran_out_still_settles(
    mailgun: FakeMailgun, now: Now
) -> None:
    t = now.t
    mailgun.add("accepted", t - 550, message_id="<fixed@acme.example>", tag="acme:1")
    for i in range(3000):
        mailgun.add("accepted", t - 500 + i * 0.1, message_id="<fixed@acme.example>", tag=f"acme:o{i}")
    attempt = Attempt("primary", t - 560, "acme:1", "<fixed@acme.example>")
    async with MailgunLog(
        provider="primary", base_url=mailgun.base_url, key=KEY, domain=mailgun.domain, wall=now, retry=FAST
    ) as client:
        v = await judge(client, attempt, t + 120)
    assert v.kind is VerdictKind.ACCEPTED


async def test_sendgrid_drops_of_some_recipients_listed_first_are_no_refusal(
    sendgrid: FakeSendgrid, now: Now
) -> None:
    t = now.t
    # One message to four recipients: SendGrid lists one row each. The one it processed
    # for the deliverable recipient is listed last (newest first); three were dropped
    # (addresses on SendGrid's own bounce list). The message was sent: not a refusal.
    sendgrid.add_message(t + 2, tag="acme:1")
    for i in range(3):
        sendgrid.add_message(t + 3 + i, tag="acme:1", dropped="Bounced Address")
    attempt = Attempt("primary", t, "acme:1", None)
    async with SendgridLog(
        provider="primary", base_url=sendgrid.base_url, key=KEY, wall=now, retry=FAST
    ) as client:
        v = await judge_safely(client, attempt, t + 120)
    assert v is not VerdictKind.REFUSED
    assert v is VerdictKind.NONE_YET


async def test_sendgrid_an_acceptance_among_the_details_read_settles(
    sendgrid: FakeSendgrid, now: Now
) -> None:
    t = now.t
    for i in range(5):
        sendgrid.add_message(t + 2 + i, tag="acme:1")
    attempt = Attempt("primary", t, "acme:1", None)
    async with SendgridLog(
        provider="primary", base_url=sendgrid.base_url, key=KEY, wall=now, retry=FAST
    ) as client:
        v = await judge(client, attempt, t + 120)
    assert v.kind is VerdictKind.ACCEPTED


async def judge_safely(client: MailgunLog | SendgridLog, attempt: Attempt, at: float) -> VerdictKind:
    """What the verdict loop's look (verdicts.ask) concludes: an API error is none yet."""
    asked = await ask(client, RECORD, attempt, VerdictsConfig(absent_after=ABSENT), at)
    return asked.verdict.kind
