"""The verdict loop a reload starts (DESIGN.md §19: a reload that gives the first provider an
`api` starts it), attacked from outside: a first `api` whose key is missing starts nothing
and breaks nothing; the reload that makes the key readable starts one loop, and every
reload after it keeps that one (never a second loop asking and settling the same records);
the loop started so settles what was lost meanwhile, and stop closes its clients. A real
client, listener, upstream sink, store and fake SendGrid log; the clock is injected. The
upstream is counted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from tests.support import Behaviour, FakeClock, Upstream, message, running_guard, send, write_config
from tests.support.provider_api_fakes import FakeMailgun, FakeSendgrid
from tests.support.verdicts import API_ENV, API_KEY, MAILGUN_DOMAIN, api_section, tag_of, verdict_config
from tests.verdicts.test_verdict_loop import MINUTE, Harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


def _loops_running() -> int:
    return sum(
        1
        for t in asyncio.all_tasks()
        if not t.done() and getattr(t.get_coro(), "__qualname__", "") == "VerdictLoop.run"
    )


async def test_reloads_start_one_loop_once_its_key_is_readable(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_ENV, raising=False)
    clock = FakeClock()
    fake = FakeSendgrid(API_KEY, clock)
    await fake.start()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", fake.base_url)
        api = cfg["providers"][0].pop("api")
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            assert guard.verdicts is None and _loops_running() == 0
            cfg["providers"][0]["api"] = api
            write_config(path, cfg)
            # The key is not in the environment: the routes take the api's tag, no loop starts.
            assert await guard.reload()
            assert guard.verdicts is None and _loops_running() == 0

            h = Harness(guard, clock, fake, upstream, "sendgrid")
            rec = await h.lose_reply("r1")
            assert rec.tagged == "sendgrid"
            h.log(h.last_received(), rec.attempts[-1].at + 1)

            monkeypatch.setenv(API_ENV, API_KEY)
            assert await guard.reload()
            loop = guard.verdicts
            assert loop is not None and _loops_running() == 1
            for _ in range(3):
                assert await guard.reload()
                assert guard.verdicts is loop and _loops_running() == 1

            clock.t += 2 * MINUTE + 1
            for _ in range(5):
                await loop.round()
                if (await h.record("r1")).state is State.DELIVERED:
                    break
                clock.t += 5 * MINUTE
            await h.record("r1", State.DELIVERED)
            dup = await send(guard.ports[0], message("r1"))
            assert dup.code == 250 and "duplicate" in dup.text
        assert _loops_running() == 0
        assert all(getattr(c, "_session", None) is None for c in loop.clients.values())
    finally:
        await fake.stop()
    assert upstream.event_keys() == ["r1"]


@pytest.mark.parametrize("change", ["added", "kind"])
async def test_a_reload_mid_send_leaves_the_note_naming_the_tag_the_message_carries(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The reload lands while the provider holds MAIL (the data_sent note is being written,
    the message already prepared): the send finishes on the provider object it began on, and
    the note says what that one wrote. `added`: no api before, SendGrid's after — the message
    went untagged and is never judged absent from a search by tag. `kind`: Postmark's before,
    SendGrid's after — the message carries Postmark's tag, which SendGrid's log is not
    searched by."""
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = FakeClock()
    fake = FakeSendgrid(API_KEY, clock)
    await fake.start()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", fake.base_url)
        sendgrid_api = cfg["providers"][0].pop("api")
        if change == "kind":
            cfg["providers"][0]["api"] = {**sendgrid_api, "kind": "postmark", "token_env": API_ENV}
            del cfg["providers"][0]["api"]["key_env"]
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            h = Harness(guard, clock, fake, upstream, "sendgrid")
            upstream.handler.script = [Behaviour(hang_at_mail=1.0, drop_after_dot=True)]
            sending = asyncio.create_task(send(guard.ports[0], message("m1")))
            await asyncio.sleep(0.3)
            cfg["providers"][0]["api"] = sendgrid_api
            write_config(path, cfg)
            assert await guard.reload()
            lost = await sending
            assert lost.code == 451 and "unknown" in lost.text
            rec = await h.record("m1", State.UNKNOWN)
            carried = {k: tag_of(h.last_received(), k) for k in ("sendgrid", "postmark")}
            assert rec.tagged == (None if change == "added" else "postmark")
            assert carried == {"sendgrid": None, "postmark": None if change == "added" else "acme:m1"}

            h.other_acceptance(rec.attempts[-1].at + 30)  # SendGrid's ingestion proof
            clock.t += 2 * MINUTE + 1
            for _ in range(40):  # SendGrid: one record a round, rounds 40 s apart
                assert guard.verdicts is not None
                await guard.verdicts.round()
                clock.t += 2 * MINUTE
            assert any("acme:m1" in str(r.query) for r in fake.requests)
            await h.record("m1", State.UNKNOWN)
            held = await send(guard.ports[0], message("m1"))
            assert held.code == 451 and "unknown" in held.text
    finally:
        await fake.stop()
    assert upstream.event_keys() == ["m1"]


OTHER_ENV = "SMTPGUARD_TEST_OTHER_LOG_API_KEY"


@pytest.mark.parametrize("change", ["api-removed", "domain-changed"])
async def test_a_reload_whose_other_key_is_unreadable_never_asks_a_log_the_message_did_not_go_to(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """One reload moves `primary` off the Mailgun domain its log client reads (its api
    removed, or another domain) and names a key for another provider's api that cannot be
    read: the loop keeps its previous clients, and says so. The one it kept for `primary`
    reads a log the messages `primary` sends from then on never reach; the domain is still
    in use (its log shows later acceptances of others), so their absence there would read
    as `not accepted`, and the retry would be the second copy."""
    monkeypatch.setenv(API_ENV, API_KEY)
    monkeypatch.setenv(OTHER_ENV, API_KEY)
    clock = FakeClock()
    mailgun = FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock)
    sendgrid = FakeSendgrid(API_KEY, clock)
    await mailgun.start()
    await sendgrid.start()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "mailgun", mailgun.base_url)
        other = {**cfg["providers"][0], "name": "other", "api": api_section("sendgrid", sendgrid.base_url)}
        other["api"]["key_env"] = OTHER_ENV
        cfg["providers"].append(other)
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            assert guard.verdicts is not None and set(guard.verdicts.clients) == {"primary", "other"}
            if change == "api-removed":
                del cfg["providers"][0]["api"]
            else:
                cfg["providers"][0]["api"]["domain"] = "mg2.acme.example"
            cfg["providers"][1]["api"]["key_env"] = "SMTPGUARD_TEST_UNSET_KEY"
            write_config(path, cfg)
            assert await guard.reload()

            h = Harness(guard, clock, mailgun, upstream, "mailgun")
            rec = await h.lose_reply("z1")
            assert rec.via == "primary"
            # Another system's message through the old domain, after z1: the proof of ingestion.
            h.other_acceptance(rec.attempts[-1].at + 30)
            clock.t += 2 * MINUTE + 1
            for _ in range(10):
                await h.loop.round()
                clock.t += 5 * MINUTE
            await h.record("z1", State.UNKNOWN)
            held = await send(guard.ports[0], message("z1"))
            assert held.code == 451 and "unknown" in held.text
    finally:
        await sendgrid.stop()
        await mailgun.stop()
    assert upstream.event_keys() == ["z1"]  # the copy primary's new provider took, never a second
