"""A reload ends what a session's AUTH no longer proves (DESIGN.md §16, runbook "Reloading").

A client that authenticated before a reload keeps its connection open as long as it likes.
If the reload removed its user, moved the user to another zone, or dropped the hash its
password matched (the last step of a rotation), the next MAIL, RCPT or final dot gets
`421 4.7.0` and the connection closes: nothing is relayed or recorded for it. A reload that
leaves the user as it was changes nothing for the session. Every case counts what the
upstream received."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smtpguard.passwords import Verifier, hash_password
from smtpguard.server import Server
from tests.support import PASSWORD, Upstream, base_config, password_hash, running_guard, write_config
from tests.support.hostile import RawClient, SmtpReply, message_bytes, nothing_recorded, session, terminated

NEW_PASSWORD = "acme-new-password"


def _changed(reply: SmtpReply) -> bool:
    return reply.code == 421 and reply.text.startswith("4.7.0 Credentials changed by a reload")


async def _reload(
    guard: Server, path: Path, cfg: dict[str, Any], change: Callable[[dict[str, Any]], None]
) -> None:
    new = copy.deepcopy(cfg)
    change(new)
    write_config(path, new)
    assert await guard.reload()


def _remove_user(cfg: dict[str, Any]) -> None:
    cfg["zones"]["acme"]["users"] = [{"username": "acme-other", "password_hash": password_hash(PASSWORD)}]


def _move_user(cfg: dict[str, Any]) -> None:
    moved = cfg["zones"]["acme"]["users"].pop()
    cfg["zones"]["acme"]["users"] = [{"username": "acme-other", "password_hash": password_hash(PASSWORD)}]
    cfg["zones"]["globex"]["users"].append(moved)
    cfg["zones"]["globex"]["senders"].append("billing@acme.example")


def _remove_zone(cfg: dict[str, Any]) -> None:
    del cfg["zones"]["acme"]


MAIL = "MAIL FROM:<billing@acme.example>"
RCPT = "RCPT TO:<customer@example.com>"


async def _after_reload(
    tmp: Path, upstream: Upstream, change: Callable[[dict[str, Any]], None], at: str
) -> None:
    """Signs in, reloads with `change`, then goes on to `at` (MAIL, RCPT or the final dot):
    the reply there is the 421, the connection then closes, and nothing was sent or recorded."""
    path = tmp / "smtpguard.yaml"
    cfg = base_config(tmp, upstream.port)
    async with running_guard(cfg, config_path=path) as guard, session(guard.ports[0]) as s:
        if at != "MAIL":
            assert (await s.command(MAIL)).code == 250
        if at == "DATA":
            assert (await s.command(RCPT)).code == 250
            assert (await s.command("DATA")).code == 354
        await _reload(guard, path, cfg, change)
        if at == "MAIL":
            reply = await s.command(MAIL)
        elif at == "RCPT":
            reply = await s.command(RCPT)
        else:
            s.write(terminated(message_bytes("reload:revoked")))
            reply = await s.reply()
        assert _changed(reply), reply
        assert await s.closed()
        assert upstream.event_keys() == []
        assert await nothing_recorded(guard, "acme", "reload:revoked")


async def test_removed_user_is_closed_at_its_next_mail(tmp: Path, upstream: Upstream) -> None:
    await _after_reload(tmp, upstream, _remove_user, "MAIL")


async def test_user_moved_to_another_zone_is_closed_at_rcpt(tmp: Path, upstream: Upstream) -> None:
    await _after_reload(tmp, upstream, _move_user, "RCPT")


async def test_removed_user_mid_transaction_sends_nothing_at_the_final_dot(
    tmp: Path, upstream: Upstream
) -> None:
    await _after_reload(tmp, upstream, _remove_user, "DATA")


async def test_removed_zone_is_closed_at_mail(tmp: Path, upstream: Upstream) -> None:
    await _after_reload(tmp, upstream, _remove_zone, "MAIL")


async def _send_on(s: RawClient, key: str) -> SmtpReply:
    assert (await s.command(MAIL)).code == 250
    assert (await s.command(RCPT)).code == 250
    return await s.data(terminated(message_bytes(key)))


async def test_end_of_a_rotation_closes_the_old_password_and_keeps_the_new(
    tmp: Path, upstream: Upstream
) -> None:
    path = tmp / "smtpguard.yaml"
    cfg = base_config(tmp, upstream.port)
    new_hash, old_hash = password_hash(NEW_PASSWORD), password_hash(PASSWORD)
    cfg["zones"]["acme"]["users"] = [{"username": "acme-app", "password_hashes": [new_hash, old_hash]}]

    def rotated(c: dict[str, Any]) -> None:
        c["zones"]["acme"]["users"] = [{"username": "acme-app", "password_hash": new_hash}]

    async with running_guard(cfg, config_path=path) as guard:
        port = guard.ports[0]
        async with session(port) as old, session(port, password=NEW_PASSWORD) as new:
            await _reload(guard, path, cfg, rotated)
            reply = await old.command(MAIL)
            assert _changed(reply), reply
            assert await old.closed()
            sent = await _send_on(new, "reload:new-password")
            assert sent.code == 250, f"the new password's session goes on: {sent}"
    assert upstream.event_keys() == ["reload:new-password"]


async def test_a_reload_that_keeps_the_user_changes_nothing_for_its_session(
    tmp: Path, upstream: Upstream
) -> None:
    path = tmp / "smtpguard.yaml"
    cfg = base_config(tmp, upstream.port)

    def unrelated(c: dict[str, Any]) -> None:
        c["zones"]["globex"]["senders"].append("@other.globex.example")

    async with running_guard(cfg, config_path=path) as guard, session(guard.ports[0]) as s:
        await _reload(guard, path, cfg, unrelated)
        sent = await _send_on(s, "reload:kept")
        assert sent.code == 250, sent
    assert upstream.event_keys() == ["reload:kept"]


async def test_verify_any_names_the_hash_the_password_matched() -> None:
    new, old = hash_password("new"), hash_password("old")
    verifier = Verifier()
    assert await verifier.verify_any("u", [new, old], "old", pad_to=2) == old
    assert await verifier.verify_any("u", [new, old], "old", pad_to=2) == old, "the cached answer"
    assert await verifier.verify_any("u", [new, old], "new", pad_to=2) == new
    assert await verifier.verify_any("u", [new], "new") == new
    assert await verifier.verify_any("u", [new, old], "neither", pad_to=2) is None
