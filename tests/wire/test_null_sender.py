"""The null reverse-path `MAIL FROM:<>` (RFC 5321 §4.1.1.2, §3.6.3) on the submission
listener. It is SMTP syntax, not a syntax error: it names no sender, so no zone maps it, and
DESIGN.md §3 answers a sender the zone does not map with 550 5.7.1 at MAIL. aiosmtpd
answered 501 5.5.4 "Syntax" itself, before smtpguard's sender check was asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import message_bytes, session, terminated

pytestmark = pytest.mark.usefixtures("no_tracebacks")


@pytest.mark.parametrize("line", ["MAIL FROM:<>", "MAIL FROM: <>", "mail from:<> SIZE=100"])
async def test_the_null_sender_is_not_mapped_for_the_zone(tmp: Path, upstream: Upstream, line: str) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        refused = await c.command(line)
        # The session goes on: the next MAIL is a transaction of its own, relayed once.
        sender = await c.command("MAIL FROM:<billing@acme.example>")
        rcpt = await c.command("RCPT TO:<customer@example.com>")
        sent = await c.data(terminated(message_bytes("null:1")))
    assert refused.code == 550 and refused.enhanced == "5.7.1", refused
    assert sender.code == 250 and rcpt.code == 250 and sent.code == 250, (sender, rcpt, sent)
    assert len(upstream.received) == 1


async def test_the_null_sender_before_auth_within_a_transaction_and_with_any_parameters(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        async with session(guard.ports[0], login=False) as c:
            unauthenticated = await c.command("MAIL FROM:<>")
        async with session(guard.ports[0]) as c:
            any_params = await c.command("MAIL FROM:<> BODY=BINARYMIME")
            first = await c.command("MAIL FROM:<billing@acme.example>")
            nested = await c.command("MAIL FROM:<>")
    assert unauthenticated.code == 530, unauthenticated
    # Whatever its parameters say, no zone maps it.
    assert any_params.code == 550 and any_params.enhanced == "5.7.1", any_params
    assert first.code == 250 and nested.code == 503, (first, nested)
    assert upstream.received == []
