"""A session that only errs or idles in place is ended (Postfix's hard error and junk command
limits): `limits.max_errors` error replies, or `limits.max_junk_commands` NOOP/RSET/VRFY/EXPN/
HELP and then `max_errors` more, since the session last had a message accepted, and it gets
`421 4.7.0` and is closed. A client that delivers starts afresh, so a long session of many
messages is never cut. Every case counts what the upstream received."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from smtpguard.config import ConfigError, loads
from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import (
    MAILBOX,
    RawClient,
    SmtpReply,
    message_bytes,
    nothing_recorded,
    session,
    terminated,
)

MAIL = "MAIL FROM:<billing@acme.example>"
RCPT = "RCPT TO:<customer@example.com>"


def _closed_for_errors(reply: SmtpReply) -> bool:
    return reply.code == 421 and reply.text.startswith("4.7.0 Too many errors in this session")


async def test_a_stranger_s_refused_commands_end_the_session_at_max_errors(
    tmp: Path, upstream: Upstream
) -> None:
    """nmap's open-relay probe and its kin: MAIL without AUTH, over and over."""
    cfg = base_config(tmp, upstream.port)
    async with running_guard(cfg) as guard, session(guard.ports[0], login=False) as c:
        codes = [(await c.command(MAIL)).code for _ in range(20)]
        assert codes == [530] * 20, codes
        last = await c.reply()
        assert _closed_for_errors(last), last
        assert await c.closed()
    assert upstream.event_keys() == []


async def test_out_of_order_commands_end_the_session_at_max_errors(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        codes = [(await c.command(RCPT)).code for _ in range(20)]  # RCPT before MAIL
        assert codes == [503] * 20, codes
        last = await c.reply()
        assert _closed_for_errors(last), last
        assert await c.closed()
    assert upstream.event_keys() == []


async def test_a_noop_flood_ends_after_the_junk_limit_and_max_errors_more(
    tmp: Path, upstream: Upstream
) -> None:
    cfg = base_config(tmp, upstream.port, limits={"max_junk_commands": 30, "max_errors": 5})
    async with running_guard(cfg) as guard, session(guard.ports[0], login=False) as c:
        codes = [(await c.command("NOOP")).code for _ in range(34)]
        assert codes == [250] * 34, codes
        # The 35th is the fifth past the limit: answered, then the session is closed.
        assert (await c.command("NOOP")).code == 250
        last = await c.reply()
        assert _closed_for_errors(last), last
        assert await c.closed()
    assert upstream.event_keys() == []


async def test_a_delivered_message_starts_the_counts_afresh(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, limits={"max_junk_commands": 3, "max_errors": 4})
    async with running_guard(cfg) as guard, session(guard.ports[0]) as c:
        for n in range(3):
            for _ in range(3):  # three errors: one short of the limit
                assert (await c.command(RCPT)).code == 503
            for _ in range(3):  # junk up to the limit, not past it
                assert (await c.command("RSET")).code == 250
            assert (await c.command(MAIL)).code == 250
            assert (await c.command(RCPT)).code == 250
            sent = await c.data(terminated(message_bytes(f"errors:{n}")))
            assert sent.code == 250, sent
        # Without a delivery in between, the fourth error ends it.
        for _ in range(3):
            assert (await c.command(RCPT)).code == 503
        assert (await c.command(RCPT)).code == 503
        last = await c.reply()
        assert _closed_for_errors(last), last
        assert await c.closed()
    assert upstream.event_keys() == ["errors:0", "errors:1", "errors:2"]


def test_the_limits_default_to_postfixs_and_are_at_least_one(tmp: Path) -> None:
    limits = loads(yaml.safe_dump(base_config(tmp, 2525))).limits
    assert (limits.max_errors, limits.max_junk_commands) == (20, 100)
    for key in ("max_errors", "max_junk_commands"):
        with pytest.raises(ConfigError) as e:
            loads(yaml.safe_dump(base_config(tmp, 2525, limits={key: 0})))
        assert f"limits.{key}" in str(e.value), e.value


async def test_help_still_names_the_junk_commands(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        # As aiosmtpd lists them (its EXPN has no syntax, so HELP never named it).
        listed = "Supported commands: AUTH EHLO HELO HELP MAIL NOOP QUIT RCPT RSET VRFY"
        assert await c.command("HELP") == SmtpReply(250, listed)
        assert await c.command("HELP NOOP") == SmtpReply(250, "Syntax: NOOP [ignored]")


async def test_a_message_pipelined_behind_the_last_error_is_never_taken(
    tmp: Path, upstream: Upstream
) -> None:
    """aiosmtpd goes on reading what a client pipelined before the 421: a whole transaction
    sent behind the error that ends the session reaches no handler, and nothing is sent or
    recorded."""
    cfg = base_config(tmp, upstream.port, limits={"max_errors": 3})
    async with running_guard(cfg) as guard, session(guard.ports[0]) as c:
        for _ in range(2):
            assert (await c.command(RCPT)).code == 503
        behind = terminated(message_bytes("errors:behind"))
        c.write(f"{RCPT}\r\n{MAIL}\r\n{RCPT}\r\nDATA\r\n".encode() + behind)
        assert (await c.reply()).code == 503
        last = await c.reply()
        assert _closed_for_errors(last), last
        assert await c.closed()
        assert await nothing_recorded(guard, "acme", "errors:behind")
    assert upstream.event_keys() == []


async def test_the_events_mailbox_ends_a_noop_flood_at_postfixs_limits(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, events={"mailbox": MAILBOX})
    async with running_guard(cfg) as guard:
        assert guard.mailbox is not None
        client = await RawClient.connect(guard.mailbox.port)
        try:
            assert (await client.reply()).code == 220
            # 100 junk commands, then 20 more that each count as an error: the 120th ends it.
            codes = [(await client.command("NOOP")).code for _ in range(120)]
            assert codes == [250] * 120, codes
            last = await client.reply()
            assert _closed_for_errors(last), last
            assert await client.closed()
        finally:
            await client.close()
    assert upstream.event_keys() == []
