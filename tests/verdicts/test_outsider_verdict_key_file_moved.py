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

from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from tests.support import UPSTREAM_USER, FakeClock, Upstream, message, running_guard, send, write_config
from tests.support.provider_api_fakes import FakeSendgrid
from tests.support.verdicts import API_ENV, API_KEY, verdict_config
from tests.verdicts.test_verdict_loop import MINUTE, Harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)

OLD_ACCOUNT = "SG.old-account-key-0123456789"
NEW_ACCOUNT = "SG.new-account-key-9876543210"


async def test_a_key_file_moved_to_another_account_never_proves_absence_in_the_old_one(
    tmp: Path, store_url: str
) -> None:
    clock = FakeClock()
    upstream = Upstream(password=OLD_ACCOUNT)
    old_log = FakeSendgrid(OLD_ACCOUNT, clock)
    await upstream.start()
    await old_log.start()
    secret = tmp / "sendgrid.key"
    secret.write_text(OLD_ACCOUNT + "\n")
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", old_log.base_url)
        cfg["providers"][0].update({"username": UPSTREAM_USER, "password_file": str(secret)})
        api = cfg["providers"][0]["api"]
        del api["key_env"]
        api["key_file"] = str(secret)
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            h = Harness(guard, clock, old_log, upstream, "sendgrid")
            # The move: the file names the new account, whose endpoint takes only its key.
            secret.write_text(NEW_ACCOUNT + "\n")
            upstream.rotate(NEW_ACCOUNT)
            write_config(path, cfg)
            assert await guard.reload()
            rec = await h.lose_reply("k1")
            assert upstream.password == NEW_ACCOUNT and upstream.auth_ok >= 1
            h.other_acceptance(rec.attempts[-1].at + 30)  # the old account's own traffic
            for _ in range(12):
                await h.after(5 * MINUTE)
            retry = await send(guard.ports[0], message("k1"))
            assert (retry.code, upstream.event_keys()) == (451, ["k1"]), "the retry sent a second copy"
            await h.record("k1", State.UNKNOWN)
    finally:
        await old_log.stop()
        await upstream.stop()
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
    upstream = Upstream(password=OLD_ACCOUNT)
    old_log = FakeSendgrid(OLD_ACCOUNT, clock)
    await upstream.start()
    await old_log.start()
    secret = tmp / "sendgrid.key"
    secret.write_text(OLD_ACCOUNT + "\n")
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", old_log.base_url)
        cfg["providers"][0].update({"username": UPSTREAM_USER, "password_file": str(secret)})
        api = cfg["providers"][0]["api"]
        del api["key_env"]
        api["key_file"] = str(secret)
        async with running_guard(cfg, clock=clock) as guard:
            h = Harness(guard, clock, old_log, upstream, "sendgrid")
            secret.write_text(NEW_ACCOUNT + "\n")
            upstream.rotate(NEW_ACCOUNT)
            rec = await h.lose_reply("k2")
            assert upstream.auth_refused >= 1 and upstream.auth_ok >= 1  # the 535, then the new key
            h.other_acceptance(rec.attempts[-1].at + 30)  # the old account's own traffic
            for _ in range(12):
                await h.after(5 * MINUTE)
            retry = await send(guard.ports[0], message("k2"))
            assert (retry.code, upstream.event_keys()) == (451, ["k2"]), "the retry sent a second copy"
            await h.record("k2", State.UNKNOWN)
    finally:
        await old_log.stop()
        await upstream.stop()
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
    upstream = Upstream(password=OLD_ACCOUNT)
    account = FakeSendgrid(OLD_ACCOUNT, clock)
    await upstream.start()
    await account.start()
    secret = tmp / "sendgrid.key"
    secret.write_text(OLD_ACCOUNT + "\n")
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", account.base_url)
        cfg["providers"][0].update({"username": UPSTREAM_USER, "password_file": str(secret)})
        api = cfg["providers"][0]["api"]
        del api["key_env"]
        api["key_file"] = str(secret)
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            h = Harness(guard, clock, account, upstream, "sendgrid")
            await h.lost_and_logged("r1")  # taken: its log says so
            rotated = NEW_ACCOUNT.replace("new-account", "same-account")
            secret.write_text(rotated + "\n")
            account.key = rotated
            upstream.rotate(rotated)
            assert await guard.reload()
            after = await h.lose_reply("r2")  # never taken: its log will never show it
            h.other_acceptance(after.attempts[-1].at + 30)
            for _ in range(12):
                await h.after(5 * MINUTE)
            await h.record("r1", State.DELIVERED)
            await h.record("r2", State.DEFERRED)
            dup = await send(guard.ports[0], message("r1"))
            assert dup.code == 250 and "duplicate" in dup.text
            again = await send(guard.ports[0], message("r2"))
            assert again.code == 250 and "duplicate" not in again.text
    finally:
        await account.stop()
        await upstream.stop()
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
    upstream = Upstream(password="smtp-old")
    account = FakeSendgrid(API_KEY, clock)
    await upstream.start()
    await account.start()
    secret = tmp / "smtp.pass"
    secret.write_text("smtp-old\n")
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", account.base_url)
        cfg["providers"][0].update({"username": UPSTREAM_USER, "password_file": str(secret)})
        async with running_guard(cfg, clock=clock) as guard:
            h = Harness(guard, clock, account, upstream, "sendgrid")
            secret.write_text("smtp-new\n")
            upstream.rotate("smtp-new")
            rec = await h.lose_reply("p1")  # never taken: its log will never show it
            assert upstream.auth_refused >= 1 and upstream.auth_ok >= 1  # the 535, then the new one
            h.other_acceptance(rec.attempts[-1].at + 30)
            for _ in range(12):
                await h.after(5 * MINUTE)
            await h.record("p1", State.DEFERRED)
            again = await send(guard.ports[0], message("p1"))
            assert again.code == 250 and "duplicate" not in again.text
    finally:
        await account.stop()
        await upstream.stop()
    assert upstream.event_keys() == ["p1", "p1"]
