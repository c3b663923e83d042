"""A SendGrid provider whose SMTP password and log `api` key are one file (SendGrid's SMTP
password is an API key), rewritten in place to move the provider to another account, and a
SIGHUP. The SMTP side reads the file again on every reload (rotate_passwords): the next
message authenticates as the new account and goes there. The log side read the key only when
the route and the loop's clients were built: with the providers' settings unchanged, neither
is rebuilt, so the data_sent note still names the old account's log and the loop still reads
it. The message is absent from the old account's log, that account's own traffic is the
proof of ingestion, and `not accepted` let the retry send a second copy (upstream k1 twice).
Now a reload whose key files name other logs rebuilds those providers (their notes name the
new log) and the loop's clients: the old account's log never judges the message absent.

The upstream here is the new account's SMTP endpoint (it takes only the new key after the
move); the log API is the old account's (it takes only the old key)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard.policy.ledger import State
from smtpguard.server import Server
from tests.support import UPSTREAM_USER, FakeClock, Upstream, message, running_guard, send, write_config
from tests.support.provider_api_fakes import FakeSendgrid
from tests.support.verdicts import API_ENV, API_KEY, verdict_config
from tests.verdicts.test_verdict_loop import MINUTE, Harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)

OLD_ACCOUNT = "SG.old-account-key-0123456789"
NEW_ACCOUNT = "SG.new-account-key-9876543210"


@contextlib.asynccontextmanager
async def shared_key_guard(
    tmp: Path,
    store_url: str,
    log: FakeSendgrid,
    upstream: Upstream,
    clock: FakeClock,
    *,
    password: str = OLD_ACCOUNT,
    key_file: bool = True,
) -> AsyncIterator[tuple[Server, Harness, dict[str, Any], Path, Path]]:
    """A guard on `upstream` and the SendGrid `log`, its SMTP password the file `secret`
    (holding `password`) and, with `key_file`, its api's key that same file. Yields the
    guard, a Harness, the config, its path (for a reload) and the secret's path."""
    await upstream.start()
    await log.start()
    secret = tmp / "sendgrid.key"
    secret.write_text(password + "\n")
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", log.base_url)
        cfg["providers"][0].update({"username": UPSTREAM_USER, "password_file": str(secret)})
        if key_file:
            api = cfg["providers"][0]["api"]
            del api["key_env"]
            api["key_file"] = str(secret)
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            yield guard, Harness(guard, clock, log, upstream, "sendgrid"), cfg, path, secret
    finally:
        await log.stop()
        await upstream.stop()


async def settle_rounds(h: Harness, lost: str) -> None:
    """Another message's acceptance after `lost`'s attempt (the ingestion proof), then an
    hour of the loop's rounds: past absent_after."""
    rec = await h.record(lost)
    h.other_acceptance(rec.attempts[-1].at + 30)
    for _ in range(12):
        await h.after(5 * MINUTE)


async def test_a_key_file_moved_to_another_account_never_proves_absence_in_the_old_one(
    tmp: Path, store_url: str
) -> None:
    clock = FakeClock()
    upstream, old_log = Upstream(password=OLD_ACCOUNT), FakeSendgrid(OLD_ACCOUNT, clock)
    async with shared_key_guard(tmp, store_url, old_log, upstream, clock) as (guard, h, cfg, path, secret):
        # The move: the file names the new account, whose endpoint takes only its key.
        secret.write_text(NEW_ACCOUNT + "\n")
        upstream.rotate(NEW_ACCOUNT)
        write_config(path, cfg)
        assert await guard.reload()
        await h.lose_reply("k1")
        assert upstream.password == NEW_ACCOUNT and upstream.auth_ok >= 1
        await settle_rounds(h, "k1")  # the proof: the old account's own traffic
        retry = await send(guard.ports[0], message("k1"))
        assert (retry.code, upstream.event_keys()) == (451, ["k1"]), "the retry sent a second copy"
        await h.record("k1", State.UNKNOWN)
    assert upstream.event_keys() == ["k1"]


async def test_a_535_that_reads_the_moved_file_before_any_reload_never_proves_absence_in_the_old_log(
    tmp: Path, store_url: str
) -> None:
    """The file already names the new account (the SIGHUP has not come yet) when the old
    account's SMTP refuses AUTH (a transient 535, or its sending access withdrawn while its
    API still reads its log): the one re-read after the 535 authenticates as the new account
    and the message goes there, noted with the old account's log, which the loop reads (k2
    twice upstream). Now a 535 that moves the provider to another secret leaves its notes
    naming no log until a reload reads the password and the key together."""
    clock = FakeClock()
    upstream, old_log = Upstream(password=OLD_ACCOUNT), FakeSendgrid(OLD_ACCOUNT, clock)
    async with shared_key_guard(tmp, store_url, old_log, upstream, clock) as (guard, h, _cfg, _path, secret):
        secret.write_text(NEW_ACCOUNT + "\n")
        upstream.rotate(NEW_ACCOUNT)
        await h.lose_reply("k2")
        assert upstream.auth_refused >= 1 and upstream.auth_ok >= 1  # the 535, then the new key
        await settle_rounds(h, "k2")  # the proof: the old account's own traffic
        retry = await send(guard.ports[0], message("k2"))
        assert (retry.code, upstream.event_keys()) == (451, ["k2"]), "the retry sent a second copy"
        await h.record("k2", State.UNKNOWN)
    assert upstream.event_keys() == ["k2"]


async def test_a_key_rotated_within_one_account_still_settles_both_sides_of_the_reload(
    tmp: Path, store_url: str
) -> None:
    """The same file rewritten with a new key of the same account (the old one revoked at
    the API and the SMTP endpoint): the record lost before the reload is still settled by
    its acceptance in the log, and one lost after it (never taken) by its absence, as the
    notes and the loop's client name the same log again (before the reload read the key, the
    loop kept asking with the revoked one and settled neither). Only a record noted with the
    old key is never judged absent (its note names another key)."""
    clock = FakeClock()
    upstream, account = Upstream(password=OLD_ACCOUNT), FakeSendgrid(OLD_ACCOUNT, clock)
    async with shared_key_guard(tmp, store_url, account, upstream, clock) as (guard, h, _cfg, _path, secret):
        await h.lost_and_logged("r1")  # taken: its log says so
        rotated = NEW_ACCOUNT.replace("new-account", "same-account")
        secret.write_text(rotated + "\n")
        account.key = rotated
        upstream.rotate(rotated)
        assert await guard.reload()
        await h.lose_reply("r2")  # never taken: its log will never show it
        await settle_rounds(h, "r2")
        await h.record("r1", State.DELIVERED)
        await h.record("r2", State.DEFERRED)
        dup = await send(guard.ports[0], message("r1"))
        assert dup.code == 250 and "duplicate" in dup.text
        again = await send(guard.ports[0], message("r2"))
        assert again.code == 250 and "duplicate" not in again.text
    # r2's copy the provider never took, and its one resend
    assert sorted(k or "" for k in upstream.event_keys()) == ["r1", "r2", "r2"]


async def test_a_535_on_an_smtp_password_of_its_own_file_keeps_the_notes_naming_the_log(
    tmp: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SMTP password in a file of its own (the api's key elsewhere, unchanged) rotated in
    place and met by a 535 before any reload: the re-read secret is the same account's as far
    as smtpguard can tell, the notes keep naming the api's log, and a message never taken is
    still settled by its absence (its resend is the one other copy)."""
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = FakeClock()
    upstream, account = Upstream(password="smtp-old"), FakeSendgrid(API_KEY, clock)
    guarded = shared_key_guard(tmp, store_url, account, upstream, clock, password="smtp-old", key_file=False)
    async with guarded as (guard, h, _cfg, _path, secret):
        secret.write_text("smtp-new\n")
        upstream.rotate("smtp-new")
        await h.lose_reply("p1")  # never taken: its log will never show it
        assert upstream.auth_refused >= 1 and upstream.auth_ok >= 1  # the 535, then the new one
        await settle_rounds(h, "p1")
        await h.record("p1", State.DEFERRED)
        again = await send(guard.ports[0], message("p1"))
        assert again.code == 250 and "duplicate" not in again.text
    assert upstream.event_keys() == ["p1", "p1"]
