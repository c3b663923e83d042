"""Outsider tests of a reload meeting a session's AUTH (listener/handler.py `entitled`): the
reload lands while the password is being verified, or while the session's message is being
relayed. Real sockets, a real recording upstream, the config file re-read as SIGHUP does."""

from __future__ import annotations

import asyncio
import base64
import copy
from pathlib import Path
from typing import Any

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
from tests.support.hostile import message_bytes, nothing_recorded, session, terminated

MAIL = "MAIL FROM:<billing@acme.example>"
RCPT = "RCPT TO:<customer@example.com>"
AUTH = "AUTH PLAIN " + base64.b64encode(f"\0acme-app\0{PASSWORD}".encode()).decode()


async def test_a_reload_while_auth_verifies_the_password_ends_the_session_at_mail(
    tmp: Path, upstream: Upstream
) -> None:
    """The password's verification has begun on what the old file said when a reload removing
    the user is applied. AUTH then succeeds (235), and the session's first MAIL is 421:
    nothing sent or recorded. Five rounds, each with a fresh session and the user put back.

    The verification is held at its start until the reload is in: the real argon2 check
    then runs. A sleep standing in for "the AUTH line has been read" was too short on a
    loaded machine, where the reload landed first and AUTH was rightly refused."""
    path = tmp / "smtpguard.yaml"
    cfg = base_config(tmp, upstream.port)
    cfg["zones"]["acme"]["users"] = [{"username": "acme-app", "password_hash": hash_password(PASSWORD)}]
    removed = copy.deepcopy(cfg)
    removed["zones"]["acme"]["users"] = [{"username": "acme-other", "password_hash": password_hash(PASSWORD)}]
    async with running_guard(cfg, config_path=path) as guard:
        assert guard.handler is not None
        verifier = guard.handler.verifier
        verifying, reloaded = asyncio.Event(), asyncio.Event()
        verify_any = verifier.verify_any

        async def held_until_reloaded(*args: Any, **kwargs: Any) -> str | None:
            verifying.set()
            await reloaded.wait()
            return await verify_any(*args, **kwargs)

        verifier.verify_any = held_until_reloaded  # type: ignore[method-assign]
        for n in range(5):
            verifier._cache.clear()  # each round verifies for real
            verifying.clear()
            reloaded.clear()
            async with session(guard.ports[0], login=False) as c:
                c.write(f"{AUTH}\r\n".encode())
                await asyncio.wait_for(verifying.wait(), 10)
                write_config(path, removed)
                assert await guard.reload()
                reloaded.set()
                # The reload is applied and the AUTH reply not yet written: it was in flight.
                assert not c.reader._buffer, (n, bytes(c.reader._buffer))
                auth = await c.reply()
                assert auth.code == 235, (n, auth)
                reply = await c.command(MAIL)
                assert reply.code == 421 and reply.text.startswith("4.7.0 Credentials changed"), (n, reply)
                assert await c.closed()
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
