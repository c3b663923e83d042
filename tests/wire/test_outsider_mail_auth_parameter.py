"""The AUTH parameter of MAIL FROM (RFC 4954 §5), as sendmail and other MTAs send it to a
smarthost that advertised AUTH: `MAIL FROM:<a> SIZE=1234 AUTH=<>`.

The parameter belongs to the AUTH extension smtpguard's EHLO offers, so it may not be
refused as unknown (aiosmtpd answered 555 "parameters not recognized", and the MTA gave
every message up). A server that does not trust the identity it names treats it as
`AUTH=<>` (§5): smtpguard takes it and ignores it; the sender is judged as always, and the
parameter never reaches the provider. Counted at the recording upstream."""

from __future__ import annotations

from pathlib import Path

import aiosmtplib
import pytest

from tests.support import PASSWORD, Upstream, base_config, running_guard
from tests.support.hostile import message_bytes, session, terminated

pytestmark = pytest.mark.usefixtures("no_tracebacks")


@pytest.mark.parametrize(
    "parameters",
    ["AUTH=<>", "SIZE=300 AUTH=<>", "AUTH=billing+40acme.example BODY=8BITMIME", "auth=<>"],
)
async def test_mail_from_with_the_auth_parameter_is_taken_and_relayed_once(
    tmp: Path, upstream: Upstream, parameters: str
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        mail = await c.command(f"MAIL FROM:<billing@acme.example> {parameters}")
        rcpt = await c.command("RCPT TO:<customer@example.com>")
        data = await c.data(terminated(message_bytes("auth-param:1")))
    assert (mail.code, rcpt.code, data.code) == (250, 250, 250), (mail, rcpt, data)
    assert upstream.event_keys() == ["auth-param:1"]


async def test_a_real_client_sending_auth_on_mail(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        client = aiosmtplib.SMTP(hostname="127.0.0.1", port=guard.ports[0], start_tls=False)
        await client.connect()
        await client.login("acme-app", PASSWORD)
        errors, _ = await client.sendmail(
            "billing@acme.example",
            ["customer@example.com"],
            message_bytes("auth-param:2"),
            mail_options=["AUTH=<>"],
        )
        await client.quit()
    assert errors == {}
    assert upstream.event_keys() == ["auth-param:2"]


async def test_the_parameter_changes_nothing_the_sender_is_judged_as_always(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        async with session(guard.ports[0]) as c:
            # Naming a mapped sender in AUTH= does not make an unmapped envelope sender one.
            other = await c.command("MAIL FROM:<ceo@globex.example> AUTH=billing+40acme.example")
            empty = await c.command("MAIL FROM:<billing@acme.example> AUTH=")
            unknown = await c.command("MAIL FROM:<billing@acme.example> AUTH=<> XFOO=1")
        async with session(guard.ports[0], login=False) as c:
            before_auth = await c.command("MAIL FROM:<billing@acme.example> AUTH=<>")
        async with session(guard.ports[0]) as c:
            await c.command("MAIL FROM:<billing@acme.example>")
            rcpt = await c.command("RCPT TO:<customer@example.com> AUTH=<>")
    assert (other.code, other.enhanced) == (550, "5.7.1"), other
    assert empty.code == 501, empty
    assert unknown.code == 555, unknown
    assert (before_auth.code, before_auth.enhanced) == (530, "5.7.0"), before_auth
    assert rcpt.code == 555, rcpt
    assert upstream.received == []
