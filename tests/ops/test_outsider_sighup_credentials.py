"""SIGHUP to a real `serve` with `workers: 2` that removes a user: every session that user
signed in on, whichever worker holds it, gets `421 4.7.0 Credentials changed by a reload`
at its next MAIL, and nothing of it reaches the upstream; another zone's session on the same
workers goes on sending. Counted at the upstream."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.ops.test_workers import pool, wait_for
from tests.support import OTHER_PASSWORD, PASSWORD, Upstream, password_hash, write_config
from tests.support.hostile import RawClient, message_bytes, terminated

SESSIONS = 16
"""Spread over the two workers by the kernel: all on one of them 1 time in 2^15."""


async def _signed_in(port: int, user: str, password: str) -> RawClient:
    c = await RawClient.connect(port)
    assert (await c.reply()).code == 220
    assert (await c.ehlo()).code == 250
    assert (await c.login(user, password)).code == 235
    return c


async def test_sighup_removing_a_user_ends_its_sessions_on_every_worker(
    tmp: Path, upstream: Upstream
) -> None:
    async with pool(tmp, upstream) as p:
        acme = [await _signed_in(p.port, "acme-app", PASSWORD) for _ in range(SESSIONS)]
        globex = await _signed_in(p.port, "globex-app", OTHER_PASSWORD)
        try:
            cfg = p.cfg
            cfg["zones"]["acme"]["users"] = [{"username": "acme-other", "password_hash": password_hash("x")}]
            write_config(p.config_path, cfg)
            os.kill(p.guard.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
            await wait_for(
                "both workers reloaded",
                lambda: sum(e.get("msg") == "config reloaded" for e in p.lines()) == 2,
            )
            replies = [await c.command("MAIL FROM:<billing@acme.example>") for c in acme]
            assert all(r.code == 421 and r.text.startswith("4.7.0 Credentials changed") for r in replies), (
                replies
            )
            assert all([await c.closed() for c in acme])
            assert (await globex.command("MAIL FROM:<news@globex.example>")).code == 250
            assert (await globex.command("RCPT TO:<customer@example.com>")).code == 250
            sent = await globex.data(terminated(message_bytes("hup:globex", sender="news@globex.example")))
            assert sent.code == 250, sent
        finally:
            for c in [*acme, globex]:
                await c.close()
        revoked = [
            e for e in p.lines() if e.get("msg") == "session closed: its credentials were changed by a reload"
        ]
        assert len(revoked) == SESSIONS, revoked
        assert {e["worker"] for e in revoked} == {0, 1}, revoked
    assert upstream.event_keys() == ["hup:globex"]
