"""Outsider tests of limits.max_errors and limits.max_junk_commands (listener/protocol.py):
real clients that deliver, as applications and relays do, are never cut by them; a session
that only errs is. Every case counts what the upstream received."""

from __future__ import annotations

import asyncio
import shutil
import smtplib
import ssl
from email import policy
from email.message import EmailMessage
from pathlib import Path

import aiosmtplib

from tests.support import PASSWORD, Upstream, base_config, running_guard, suppressions_refreshed
from tests.support.hostile import make_cert, message_bytes, session, terminated

SENDER = "billing@acme.example"


def _message(key: str) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = SENDER
    msg["To"] = "undisclosed-recipients:;"
    msg["Subject"] = key
    msg["X-Event-Key"] = key
    msg.set_content("Your invoice.\n")
    return msg


def _smtplib_send(port: int, recipients: list[str], key: str) -> dict[str, tuple[int, bytes]]:
    """smtplib's sendmail, as Django's backend calls it: every RCPT, then DATA for those
    accepted; the refused ones are returned."""
    with smtplib.SMTP("127.0.0.1", port, timeout=20) as client:
        client.login("acme-app", PASSWORD)
        return client.sendmail(SENDER, recipients, _message(key).as_bytes(policy=policy.SMTP))


async def test_smtplib_over_max_recipients_still_delivers_to_those_accepted(
    tmp: Path, upstream: Upstream
) -> None:
    """RFC 5321 4.5.3.1.10: past max_recipients, 452 and the client sends the rest in
    another transaction. 130 recipients with max_recipients 100: 30 such 452s, which are
    no error of the client's (Postfix's smtpd_recipient_overshoot_limit is apart from its
    hard error limit)."""
    recipients = [f"r{i}@example.com" for i in range(130)]
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        refused = await asyncio.to_thread(_smtplib_send, guard.ports[0], recipients, "overshoot:1")
    assert sorted(refused) == sorted(recipients[100:])
    assert {code for code, _ in refused.values()} == {452}
    assert upstream.event_keys() == ["overshoot:1"]
    assert len(upstream.received[0].rcpt_tos) == 100


async def test_a_list_message_with_many_suppressed_recipients_still_goes_to_the_rest(
    tmp: Path, upstream: Upstream
) -> None:
    """One message to 40 recipients of whom 25 bounced before and are suppressed: 25
    refusals of single recipients, and the 15 others still get the message."""
    recipients = [f"r{i}@example.com" for i in range(40)]
    suppressed = recipients[::3] + recipients[1::3][:11]
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        assert guard.store is not None
        for address in suppressed:
            await guard.store.suppress_add("acme", address, "bounced", guard.clock())
        suppressions_refreshed(guard)
        refused = await asyncio.to_thread(_smtplib_send, guard.ports[0], recipients, "list:1")
    assert sorted(refused) == sorted(suppressed) and len(suppressed) == 25
    assert {code for code, _ in refused.values()} == {550}
    assert upstream.event_keys() == ["list:1"]
    assert sorted(upstream.received[0].rcpt_tos) == sorted(set(recipients) - set(suppressed))


async def test_a_stranger_cannot_hold_a_session_with_ehlo_instead_of_noop(
    tmp: Path, upstream: Upstream
) -> None:
    """What max_junk_commands stops for NOOP (a connection held for good by a command every
    few seconds) must hold for EHLO and HELO too, which a client sends once or twice."""
    cfg = base_config(tmp, upstream.port, limits={"max_junk_commands": 30, "max_errors": 5})
    async with running_guard(cfg) as guard, session(guard.ports[0], login=False) as c:
        # After the session's own EHLO, each greeting is junk: the 35th is the fifth past it.
        greetings = [f"{'EHLO' if n % 2 else 'HELO'} client.test" for n in range(34)]
        codes = [(await c.command(line)).code for line in greetings]
        assert codes == [250] * 34, codes
        assert (await c.command("EHLO client.test")).code == 250
        last = await c.reply()
        assert last.code == 421 and last.text.startswith("4.7.0 Too many errors"), last
        assert await c.closed()
    assert upstream.event_keys() == []


async def test_a_pooled_session_of_many_messages_with_rset_and_noop_between(
    tmp: Path, upstream: Upstream
) -> None:
    """PHPMailer's SMTPKeepAlive (RSET after each message) and a pool's liveness NOOP before
    each: 250 messages on one connection, 500 junk commands, none cut."""
    cfg = base_config(tmp, upstream.port, zones__acme__hourly_cap=1000)
    async with running_guard(cfg) as guard, session(guard.ports[0]) as c:
        for n in range(250):
            assert (await c.command("NOOP")).code == 250
            assert (await c.command(f"MAIL FROM:<{SENDER}>")).code == 250
            assert (await c.command("RCPT TO:<customer@example.com>")).code == 250
            sent = await c.data(terminated(message_bytes(f"pool:{n}")))
            assert sent.code == 250, sent
            assert (await c.command("RSET")).code == 250
        assert (await c.command("QUIT")).code == 221
    assert upstream.event_keys() == [f"pool:{n}" for n in range(250)]


async def test_a_rcpt_refused_before_the_policy_still_counts(tmp: Path, upstream: Upstream) -> None:
    """Only the policy's answer about a recipient is excused: RCPT syntax errors of a
    signed-in session with a sender are errors, and at max_errors the session ends."""
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        assert (await c.command(f"MAIL FROM:<{SENDER}>")).code == 250
        codes = [(await c.command("RCPT TO:")).code for _ in range(20)]
        assert codes == [501] * 20, codes
        last = await c.reply()
        assert last.code == 421 and last.text.startswith("4.7.0 Too many errors"), last
        assert await c.closed()
    assert upstream.event_keys() == []


async def test_help_still_gives_the_syntax_of_helo_and_ehlo(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        assert (await c.command("HELP EHLO")).text == "Syntax: EHLO hostname"
        assert (await c.command("HELP HELO")).text == "Syntax: HELO hostname"


async def test_swaks_pipelining_a_list_past_max_recipients_delivers_to_those_accepted(
    tmp: Path, upstream: Upstream
) -> None:
    """swaks with PIPELINING writes MAIL, all 130 RCPTs and DATA at once, then reads the
    replies: 100 accepted, 30 refused 452, and the message goes to the 100."""
    swaks = shutil.which("swaks")
    assert swaks is not None, "apt-get install swaks (scripts/test installs it)"
    recipients = [f"r{i}@example.com" for i in range(130)]
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        argv = [swaks, "--server", f"127.0.0.1:{guard.ports[0]}", "--pipeline", "--auth", "PLAIN"]
        argv += ["--auth-user", "acme-app", "--auth-password", PASSWORD, "--from", SENDER]
        argv += ["--to", ",".join(recipients), "--header", "To: list:;"]
        argv += ["--header", "X-Event-Key: swaks:list"]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    # swaks marks what the server said with `<-` (and `<**` for an error): only those lines
    # are replies; the rest (the message it sent, its ids and dates) may hold any digits.
    said = [
        line.split(maxsplit=1)[-1] for line in out.decode().splitlines() if line.startswith(("<-", "<**"))
    ]
    assert sum(reply.startswith("452 4.5.3") for reply in said) == 30, said
    assert not any(reply.startswith("421") for reply in said), said
    assert upstream.event_keys() == ["swaks:list"]
    assert len(upstream.received[0].rcpt_tos) == 100


async def test_aiosmtplib_starttls_then_auth_is_not_junk_even_at_the_tightest_limits(
    tmp: Path, upstream: Upstream
) -> None:
    """EHLO, STARTTLS, EHLO again (a new session, RFC 3207 4.2), AUTH, then five messages
    on one connection, with max_junk_commands and max_errors at their minimum of 1: the
    two greetings are each the first of their session, so nothing is junk."""
    cert, key = make_cert(tmp)
    cfg = base_config(tmp, upstream.port, limits={"max_junk_commands": 1, "max_errors": 1})
    cfg["tls"] = {"cert": str(cert), "key": str(key)}
    cfg["listen"] = [{"address": "127.0.0.1:0", "tls": "starttls"}]
    async with running_guard(cfg) as guard:
        client = aiosmtplib.SMTP(
            hostname="localhost",
            port=guard.ports[0],
            start_tls=True,
            tls_context=ssl.create_default_context(cafile=str(cert)),
            timeout=20,
        )
        await client.connect()
        try:
            await client.login("acme-app", PASSWORD)
            for n in range(5):
                refused, _ = await client.send_message(
                    _message(f"tls:{n}"), recipients=["customer@example.com"]
                )
                assert refused == {}, refused
        finally:
            await client.quit()
    assert upstream.event_keys() == [f"tls:{n}" for n in range(5)]
