"""Hostile input over a real socket: SMTP smuggling, command injection, open-relay probes,
zone isolation. Each test counts what the recording upstream received.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import OTHER_PASSWORD, Upstream, base_config, running_guard
from tests.support.hostile import (
    message_bytes,
    nothing_recorded,
    session,
    submit,
    terminated,
)

# Every hostile case must leave no traceback in the logs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_tracebacks")


# --- SMTP smuggling (DESIGN.md §3: 550 5.5.2, nothing relayed, no key or cap touched) ----------
SMUGGLED = (
    b"MAIL FROM:<billing@acme.example>\r\n"
    b"RCPT TO:<victim@example.org>\r\n"
    b"DATA\r\n"
    b"From: billing@acme.example\r\n"
    b"To: victim@example.org\r\n"
    b"Subject: smuggled\r\n"
    b"X-Event-Key: smuggle:inner\r\n"
    b"\r\n"
    b"smuggled body\r\n"
)

END_OF_DATA_VARIANTS = [
    pytest.param(b"\n.\r\n", id="LF.CRLF"),
    pytest.param(b"\r\n.\n", id="CRLF.LF"),
    pytest.param(b"\n.\n", id="LF.LF"),
    pytest.param(b"\r.\r", id="CR.CR"),
    pytest.param(b"\r.\n", id="CR.LF"),
    pytest.param(b"\n.\r", id="LF.CR"),
    pytest.param(b"\r.\r\n", id="CR.CRLF"),
    pytest.param(b"\r\n.\r", id="CRLF.CR"),
    pytest.param(b"\r\n\x00.\r\n", id="CRLF-NUL.CRLF"),
    pytest.param(b"\r\n.\x00\r\n", id="CRLF.NUL-CRLF"),
]


@pytest.mark.parametrize("fake_end", END_OF_DATA_VARIANTS)
async def test_end_of_data_smuggling_is_550_and_the_smuggled_mail_never_reaches_upstream(
    tmp: Path, upstream: Upstream, fake_end: bytes
) -> None:
    outer = message_bytes("smuggle:outer", body=b"first body")
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        async with session(guard.ports[0]) as c:
            assert (await c.command("MAIL FROM:<billing@acme.example>")).code == 250
            assert (await c.command("RCPT TO:<customer@example.com>")).code == 250
            # The whole stream up to the one real <CRLF>.<CRLF> is one message to smtpguard.
            reply = await c.data(outer + fake_end + SMUGGLED + b".\r\n")
            assert (reply.code, reply.enhanced) == (550, "5.5.2"), reply
            # Exactly one reply came back: the session is in step (no smuggled replies queued).
            assert (await c.command("NOOP")).code == 250
            assert (await c.command("QUIT")).code == 221
        assert await nothing_recorded(guard, "acme", "smuggle:outer")
        assert await nothing_recorded(guard, "acme", "smuggle:inner")
    assert upstream.handler.transactions == 0 and upstream.received == []


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"From: billing@acme.example\nTo: customer@example.com\r\n", id="bare-LF-in-header"),
        pytest.param(b"From: billing@acme.example\rTo: customer@example.com\r\n", id="bare-CR-in-header"),
        pytest.param(b"From: billing@acme.example\x00\r\nTo: customer@example.com\r\n", id="NUL-in-header"),
        pytest.param(b"\nFrom: billing@acme.example\r\n", id="bare-LF-first-byte"),
        pytest.param(
            b"From: billing@acme.example\r\nTo: customer@example.com\r\n\r\nbody\n", id="bare-LF-in-body"
        ),
        pytest.param(
            b"From: billing@acme.example\r\nTo: customer@example.com\r\n\r\nbo\rdy", id="bare-CR-in-body"
        ),
        pytest.param(
            b"From: billing@acme.example\r\nTo: customer@example.com\r\n\r\nbo\x00dy", id="NUL-in-body"
        ),
        pytest.param(
            b"From: billing@acme.example\r\nTo: customer@example.com\r\n\r\nbody\r\r", id="CR-CR-at-end"
        ),
    ],
)
async def test_bare_cr_lf_or_nul_anywhere_in_data_is_550(
    tmp: Path, upstream: Upstream, payload: bytes
) -> None:
    message = payload.replace(b"To: customer", b"X-Event-Key: bare:1\r\nTo: customer", 1)
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        async with session(guard.ports[0]) as c:
            await c.command("MAIL FROM:<billing@acme.example>")
            await c.command("RCPT TO:<customer@example.com>")
            ending = b".\r\n" if message.endswith(b"\r\n") else b"\r\n.\r\n"
            reply = await c.data(message + ending)
            assert (reply.code, reply.enhanced) == (550, "5.5.2"), reply
        assert await nothing_recorded(guard, "acme", "bare:1")
    assert upstream.handler.transactions == 0


# --- command injection ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b"MAIL FROM:<billing@acme.example>\n", id="bare-LF-ends-command"),
        pytest.param(
            b"MAIL FROM:<billing@acme.example>\rRCPT TO:<victim@example.org>\r\n", id="bare-CR-inside"
        ),
        pytest.param(b"MAIL FROM:<billing@acme.example\x00>\r\n", id="NUL-in-address"),
        pytest.param(b"MAIL FROM:<bill\ring@acme.example>\r\n", id="CR-in-address"),
        pytest.param(b"MAIL FROM:<bill\ning@acme.example>\r\n", id="LF-in-address"),
    ],
)
async def test_bare_newline_or_nul_in_a_command_is_501_and_not_executed(
    tmp: Path, upstream: Upstream, line: bytes
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        reply = await c.command(line)
        assert (reply.code, reply.enhanced) == (501, "5.5.2"), reply
        if b"\n" in line[:-1].replace(b"\r\n", b""):
            # The rest after the bare LF is a line of its own: not a command either.
            second = await c.reply()
            assert second.code in (500, 501), second
        # The MAIL was not executed: RCPT has no transaction to join.
        rcpt = await c.command("RCPT TO:<customer@example.com>")
        assert rcpt.code == 503, rcpt
    assert upstream.handler.transactions == 0


async def test_bare_lf_in_rcpt_and_data_commands_relays_nothing(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        assert (await c.command("MAIL FROM:<billing@acme.example>")).code == 250
        assert (await c.command(b"RCPT TO:<customer@example.com>\n")).code == 501
        assert (await c.command(b"DATA\n")).code == 501
        assert (await c.command("DATA")).code == 503  # no recipient was accepted
    assert upstream.handler.transactions == 0


async def test_many_bare_lf_commands_end_the_session_and_others_are_served(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        port = guard.ports[0]
        async with session(port, login=False) as c:
            c.write(b"NOOP\n" * 20)
            replies = [await c.reply() for _ in range(10)]
            assert all(r.code == 501 for r in replies), replies
            assert await c.closed()
        ok = await submit(port, message_bytes("served:1"))
    assert ok.code == 250, ok
    assert len(upstream.received) == 1


# --- open relay (nmap smtp-open-relay's 16 envelope pairs) -------------------------------------
NMAP_DOMAIN, NMAP_FROM, NMAP_TO, SRVNAME, IP = (
    "nmap.scanme.org",
    "antispam",
    "relaytest",
    "guard.test",
    "127.0.0.1",
)
NMAP_PAIRS = [
    ("MAIL FROM:<>", f"RCPT TO:<{NMAP_TO}@{NMAP_DOMAIN}>"),
    (f"MAIL FROM:<{NMAP_FROM}@{NMAP_DOMAIN}>", f"RCPT TO:<{NMAP_TO}@{NMAP_DOMAIN}>"),
    (f"MAIL FROM:<{NMAP_FROM}@{SRVNAME}>", f"RCPT TO:<{NMAP_TO}@{NMAP_DOMAIN}>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<{NMAP_TO}@{NMAP_DOMAIN}>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<{NMAP_TO}%{NMAP_DOMAIN}@[{IP}]>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<{NMAP_TO}%{NMAP_DOMAIN}@{SRVNAME}>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f'RCPT TO:<"{NMAP_TO}@{NMAP_DOMAIN}">'),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f'RCPT TO:<"{NMAP_TO}%{NMAP_DOMAIN}">'),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<{NMAP_TO}@{NMAP_DOMAIN}@[{IP}]>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f'RCPT TO:<"{NMAP_TO}@{NMAP_DOMAIN}"@[{IP}]>'),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<{NMAP_TO}@{NMAP_DOMAIN}@{SRVNAME}>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<@[{IP}]:{NMAP_TO}@{NMAP_DOMAIN}>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<@{SRVNAME}:{NMAP_TO}@{NMAP_DOMAIN}>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<{NMAP_DOMAIN}!{NMAP_TO}>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<{NMAP_DOMAIN}!{NMAP_TO}@[{IP}]>"),
    (f"MAIL FROM:<{NMAP_FROM}@[{IP}]>", f"RCPT TO:<{NMAP_DOMAIN}!{NMAP_TO}@{SRVNAME}>"),
]
PLAIN_RCPT = f"RCPT TO:<{NMAP_TO}@{NMAP_DOMAIN}>"


PROBE_LIMITS = {"max_errors": 1000}
"""Room for a whole probe's refusals in one session."""


async def test_nmap_open_relay_pairs_without_auth_are_530(tmp: Path, upstream: Upstream) -> None:
    assert len(NMAP_PAIRS) == 16
    # Every pair in one session: more errors than limits.max_errors lets a session make
    # (tests/wire/test_session_errors.py is where that limit cuts the probe short).
    async with (
        running_guard(base_config(tmp, upstream.port, limits=PROBE_LIMITS)) as guard,
        session(guard.ports[0], login=False) as c,
    ):
        for mail, rcpt in NMAP_PAIRS:
            assert (await c.command("RSET")).code == 250
            m = await c.command(mail)
            r = await c.command(rcpt)
            assert (m.code, m.enhanced) == (530, "5.7.0"), (mail, m)
            assert (r.code, r.enhanced) == (530, "5.7.0"), (rcpt, r)
        d = await c.command("DATA")
        assert d.code == 530, d
    assert upstream.handler.transactions == 0


async def test_nmap_open_relay_pairs_with_auth_are_refused(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, limits=PROBE_LIMITS)
    async with running_guard(cfg) as guard, session(guard.ports[0]) as c:
        for mail, rcpt in NMAP_PAIRS:
            assert (await c.command("RSET")).code == 250
            # None of nmap's senders is an alias of the authenticated zone.
            m = await c.command(mail)
            assert (m.code, m.enhanced) in {(550, "5.7.1"), (501, "5.1.7"), (501, "5.5.4")}, (mail, m)
            assert (await c.command(rcpt)).code == 503
            # With a mapped sender, every relay trick in the recipient is refused as written;
            # only the plain address is a recipient (an authenticated user may mail anyone).
            assert (await c.command("RSET")).code == 250
            assert (await c.command("MAIL FROM:<billing@acme.example>")).code == 250
            r = await c.command(rcpt)
            if rcpt == PLAIN_RCPT:
                assert r.code == 250, (rcpt, r)
            else:
                assert (r.code, r.enhanced) == (501, "5.1.3"), (rcpt, r)
    assert upstream.handler.transactions == 0


@pytest.mark.parametrize(
    "sender",
    [
        pytest.param("billing%acme.example@attacker.example", id="percent-hack"),
        pytest.param("@acme.example:billing@acme.example", id="source-route"),
        pytest.param('"billing@acme.example"@attacker.example', id="quoted-local-part-with-at"),
        pytest.param('"billing"@acme.example', id="quoted-local-part"),
        pytest.param("billing@acme.example@attacker.example", id="two-ats"),
        pytest.param("attacker.example!billing@acme.example", id="bang-path"),
        pytest.param("billing(comment)@acme.example", id="comment"),
        pytest.param("sales@globex.example", id="other-zones-sender"),
        pytest.param("billing@acme.example.attacker.example", id="suffix-domain"),
    ],
)
async def test_sender_tricks_with_auth_are_refused_at_mail(
    tmp: Path, upstream: Upstream, sender: str
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        m = await c.command(f"MAIL FROM:<{sender}>")
        assert (m.code, m.enhanced) in {(550, "5.7.1"), (501, "5.1.7")}, m
        assert (await c.command("RCPT TO:<customer@example.com>")).code == 503
    assert upstream.handler.transactions == 0


# --- zone isolation -------------------------------------------------------------------------
async def test_acme_credentials_never_send_as_globex(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        port = guard.ports[0]
        envelope = await submit(
            port, message_bytes("iso:1", sender="info@globex.example"), sender="info@globex.example"
        )
        header = await submit(port, message_bytes("iso:2", sender="info@globex.example"))
    assert (envelope.code, envelope.enhanced) == (550, "5.7.1"), envelope
    assert (header.code, header.enhanced) == (550, "5.7.1"), header
    assert upstream.handler.transactions == 0


async def test_one_event_key_in_two_zones_is_two_events(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        port = guard.ports[0]
        acme = await submit(port, message_bytes("invoice:1"))
        async with session(port, user="globex-app", password=OTHER_PASSWORD) as c:
            assert (await c.command("MAIL FROM:<info@globex.example>")).code == 250
            assert (await c.command("RCPT TO:<customer@example.com>")).code == 250
            globex = await c.data(terminated(message_bytes("invoice:1", sender="info@globex.example")))
        again = await submit(port, message_bytes("invoice:1"))
        assert guard.store is not None
        records = [await guard.store.get(z, "invoice:1") for z in ("acme", "globex")]
    assert acme.code == 250 and "duplicate" not in acme.text
    assert globex.code == 250 and "duplicate" not in globex.text, globex
    assert again.code == 250 and "duplicate" in again.text
    assert all(r is not None and r.state == "delivered" for r in records), records
    assert len(upstream.received) == 2
