"""A message the relay sent without the tag a log is searched by is never judged absent from
that log (DESIGN.md §19, rule 4). An operator adds a SendGrid or Postmark `api:` while a
record is already `unknown`: its message went out before the tag was written, so the search
by tag cannot find it, although the provider took it. Before the data_sent note said which
tag was written, the loop proved it absent (nothing found, a later acceptance as the proof)
and judged it `not accepted`; the application's retry then sent the invoice twice.

A real client, listener, upstream sink (which takes the dot and drops before its 250) and
store, and a fake of the provider's log over real HTTP; the loop's clock is injected. Each
test counts what the upstream received."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from tests.support import FakeClock, Upstream, message, running_guard, send, write_config
from tests.support.cli import cli
from tests.support.eventually import eventually
from tests.support.provider_api_fakes import FakeMailgun, FakePostmark, FakeSendgrid
from tests.support.verdicts import API_ENV, API_KEY, MAILGUN_DOMAIN, message_id_of, tag_of, verdict_config
from tests.verdicts.test_verdict_loop import MINUTE, Harness, make_fake

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


@pytest.mark.parametrize("kind", ["sendgrid", "postmark"])
async def test_a_message_sent_before_the_api_was_configured_is_never_judged_absent(
    tmp: Path,
    upstream: Upstream,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kind: str,
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = FakeClock()
    fake = make_fake(kind, clock)
    await fake.start()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, kind, fake.base_url)
        api = cfg["providers"][0].pop("api")
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            h = Harness(guard, clock, fake, upstream, kind)
            before = await h.lose_reply("u1")
            assert before.tagged is None
            assert tag_of(h.last_received(), kind) is None  # no tag reached the provider
            # The provider took it: its log shows the message, without smtpguard's tag.
            assert isinstance(fake, FakeSendgrid | FakePostmark)
            fake.add_message(before.attempts[-1].at + 1, tag=None)

            cfg["providers"][0]["api"] = api
            write_config(path, cfg)
            assert await guard.reload()
            after = await h.lose_reply("t1")  # sent under the api: tagged, and noted so
            assert after.tagged == kind and tag_of(h.last_received(), kind) == "acme:t1"
            h.other_acceptance(after.attempts[-1].at + 30)  # the ingestion proof, for both

            clock.t += 2 * MINUTE + 1
            for _ in range(10):  # 47 minutes; SendGrid is asked about one record a round
                await h.loop.round()  # (serve's own loop, the same object, may take a round)
                clock.t += 5 * MINUTE
            # Past absent_after, with the proof: t1 is absent; u1 never is, though asked.
            await h.record("t1", State.DEFERRED)
            searched = " ".join(str(r.query) for r in fake.requests)
            assert "acme:u1" in searched and "acme:t1" in searched
            held = await h.record("u1", State.UNKNOWN)
            assert [a.actor for a in held.audit if a.actor.startswith("verdict:")] == []
            # `smtpguard verdict` asks the same way, and says why no absence can settle it.
            code, out = await cli(capsys, "verdict", "acme", "u1", "-c", str(path))
            assert code == 3 and "verdict: none yet; the record is unknown" in out
            assert (
                "absence proves nothing here: the message is not known to have gone to this log of primary"
                in out
            )

            # Past give_up the loop leaves it to an operator; the retry is held, never sent.
            clock.t += 24 * 3600
            await h.loop.round()
            await h.record("u1", State.UNKNOWN)
            retried = await send(guard.ports[0], message("u1"))
            assert retried.code == 451 and "unknown" in retried.text
            upstream.handler.script = []
            resent = await send(guard.ports[0], message("t1"))
            assert resent.code == 250 and "duplicate" not in resent.text
    finally:
        await fake.stop()
    # u1 once (the copy the provider took, never sent again); t1's lost copy and its resend
    assert upstream.event_keys() == ["u1", "t1", "t1"]


async def test_mailgun_finds_a_message_sent_before_its_api_by_the_message_id(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mailgun's log is searched by the Message-ID every relayed message carries: a message
    sent before the tag was written is still found, and settles."""
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = FakeClock()
    fake = FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock)
    await fake.start()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "mailgun", fake.base_url)
        api = cfg["providers"][0].pop("api")
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            h = Harness(guard, clock, fake, upstream, "mailgun")
            rec = await h.lose_reply("m1")
            assert rec.tagged is None and tag_of(h.last_received(), "mailgun") is None
            fake.add("accepted", rec.attempts[-1].at + 1, message_id=message_id_of(h.last_received()))
            cfg["providers"][0]["api"] = api
            write_config(path, cfg)
            assert await guard.reload()
            clock.t += 2 * MINUTE + 1

            async def settled() -> State:
                # This round, or serve's own loop started by the reload: whichever asks first.
                await h.loop.round()
                return (await h.record("m1")).state

            final = await eventually(
                settled, lambda state: state is State.DELIVERED, timeout=30, interval=0.05
            )
            assert final is State.DELIVERED
            assert fake.requests and all(
                r.query.get("message-id") for r in fake.requests if r.path.endswith("/events")
            )
            await h.record("m1", State.DELIVERED)
            dup = await send(guard.ports[0], message("m1"))
            assert dup.code == 250 and "duplicate" in dup.text
    finally:
        await fake.stop()
    assert upstream.event_keys() == ["m1"]
