"""Outsider tests of a reload meeting a session's AUTH (listener/handler.py `entitled`): the
reload lands while the password is being verified, or while the session's message is being
relayed. Real sockets, a real recording upstream, the config file re-read as SIGHUP does."""

from __future__ import annotations

import asyncio
import base64
import copy
from pathlib import Path

from smtpguard.passwords import hash_password
from tests.support import (
    PASSWORD,
    Behaviour,
    Upstream,
    base_config,
    password_hash,
    running_guard,
    write_config,
)
from tests.support.hostile import RawClient, message_bytes, nothing_recorded, session, terminated

MAIL = "MAIL FROM:<billing@acme.example>"
RCPT = "RCPT TO:<customer@example.com>"
AUTH = "AUTH PLAIN " + base64.b64encode(f"\0acme-app\0{PASSWORD}".encode()).decode()


async def test_a_reload_while_auth_verifies_the_password_ends_the_session_at_mail(
    tmp: Path, upstream: Upstream
) -> None:
    """The user's hash has production argon2 cost, so the verification is still running off
    the event loop when a reload removing the user is applied. AUTH then succeeds on what
    the old file said (235), and the session's first MAIL is 421: nothing sent or recorded.
    Five rounds, each with a fresh session and the user put back."""
    path = tmp / "smtpguard.yaml"
    cfg = base_config(tmp, upstream.port)
    cfg["zones"]["acme"]["users"] = [{"username": "acme-app", "password_hash": hash_password(PASSWORD)}]
    removed = copy.deepcopy(cfg)
    removed["zones"]["acme"]["users"] = [{"username": "acme-other", "password_hash": password_hash(PASSWORD)}]
    async with running_guard(cfg, config_path=path) as guard:
        assert guard.handler is not None
        verifier = guard.handler.verifier
        for n in range(5):
            verifier._cache.clear()  # each round verifies for real
            c = await RawClient.connect(guard.ports[0])
            assert (await c.reply()).code == 220
            assert (await c.ehlo()).code == 250
            c.write(f"{AUTH}\r\n".encode())
            await asyncio.sleep(0.005)  # the AUTH line is read and its verification under way
            write_config(path, removed)
            assert await guard.reload()
            # The reload is applied and the AUTH reply not yet written: it was in flight.
            assert not c.reader._buffer, (n, bytes(c.reader._buffer))
            auth = await c.reply()
            assert auth.code == 235, (n, auth)
            reply = await c.command(MAIL)
            assert reply.code == 421 and reply.text.startswith("4.7.0 Credentials changed"), (n, reply)
            assert await c.closed()
            await c.close()
            write_config(path, cfg)
            assert await guard.reload()
        assert upstream.event_keys() == []
        assert await nothing_recorded(guard, "acme", "reload:auth")


async def test_a_reload_while_the_message_is_relayed_delivers_it_once_then_ends_the_session(
    tmp: Path, upstream: Upstream
) -> None:
    """The final dot was entitled: the relay under way is not undone by a reload that then
    removes the user. The client gets its 250, the upstream has the message once, and the
    session's next MAIL is 421."""
    held = asyncio.Event()
    upstream.handler.script.append(Behaviour(hold_after_dot=held))
    path = tmp / "smtpguard.yaml"
    cfg = base_config(tmp, upstream.port)
    removed = copy.deepcopy(cfg)
    removed["zones"]["acme"]["users"] = [{"username": "acme-other", "password_hash": password_hash(PASSWORD)}]
    async with running_guard(cfg, config_path=path) as guard, session(guard.ports[0]) as c:
        assert (await c.command(MAIL)).code == 250
        assert (await c.command(RCPT)).code == 250
        assert (await c.command("DATA")).code == 354
        c.write(terminated(message_bytes("reload:relayed")))
        await upstream.wait_received(1)
        write_config(path, removed)
        assert await guard.reload()
        held.set()
        sent = await c.reply()
        assert sent.code == 250 and "duplicate" not in sent.text, sent
        reply = await c.command(MAIL)
        assert reply.code == 421 and reply.text.startswith("4.7.0 Credentials changed"), reply
        assert await c.closed()
    assert upstream.event_keys() == ["reload:relayed"]
