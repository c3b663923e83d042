"""One recipient named several times in one transaction (RCPT TO repeated, or the same
address with its domain in another case) gets one copy. The upstream is told each address
once, as Postfix's cleanup does (duplicate_filter_limit): a provider that does not dedupe
recipients would deliver the event to that mailbox once per RCPT."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.limits import month_of
from smtpguard.submission import Principal
from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import message_bytes, submit

pytestmark = pytest.mark.usefixtures("no_tracebacks")


@pytest.mark.parametrize(
    ("recipients", "expected"),
    [
        pytest.param(["customer@example.com"] * 3, ["customer@example.com"], id="same-three-times"),
        pytest.param(
            ["customer@example.com", "customer@EXAMPLE.COM", "customer@Example.com"],
            ["customer@example.com"],
            id="domain-case",
        ),
        pytest.param(
            ["a@example.com", "b@example.com", "a@example.com", "b@example.com"],
            ["a@example.com", "b@example.com"],
            id="two-interleaved",
        ),
        # RFC 5321 §2.4: the local part may be case-sensitive; two spellings stay two.
        pytest.param(
            ["Bob@example.com", "bob@example.com"], ["Bob@example.com", "bob@example.com"], id="local-case"
        ),
    ],
)
async def test_a_repeated_recipient_is_relayed_once(
    tmp: Path, upstream: Upstream, recipients: list[str], expected: list[str]
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        reply = await submit(guard.ports[0], message_bytes("rcpt:dup"), recipients=recipients)
        assert guard.store is not None
        now = guard.clock()
        usage = await guard.store.cap_usage("acme", now, month_of(now))
    assert reply.code == 250 and "duplicate" not in reply.text, reply
    assert [r.rcpt_tos for r in upstream.received] == [expected]
    assert usage.hour == 1 and usage.month == 1


async def test_a_submission_naming_a_recipient_twice_relays_it_once(tmp: Path, upstream: Upstream) -> None:
    # Every path into the submitter (the outbox's rcpt_to array too), not only SMTP's RCPT.
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        assert guard.submitter is not None
        result = await guard.submitter.submit(
            Principal("acme", "acme-app"),
            "billing@acme.example",
            ["customer@example.com", "other@example.com", "customer@example.com"],
            message_bytes("rcpt:direct"),
        )
    assert result.reply.code == 250, result.reply
    assert [r.rcpt_tos for r in upstream.received] == [["customer@example.com", "other@example.com"]]
