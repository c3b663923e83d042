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
from tests.support import Upstream, message, send
from tests.support.cli import cli
from tests.support.eventually import eventually
from tests.support.provider_api_fakes import FakeMailgun, FakePostmark, FakeSendgrid
from tests.support.verdicts import MINUTE, message_id_of, tag_of, verdict_harness

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
    async with verdict_harness(tmp, upstream, store_url, monkeypatch, kind, api=False) as h:
        before = await h.lose_reply("u1")
        assert before.tagged is None
        assert tag_of(h.last_received(), kind) is None  # no tag reached the provider
        # The provider took it: its log shows the message, without smtpguard's tag.
        fake = h.fake
        assert isinstance(fake, FakeSendgrid | FakePostmark)
        fake.add_message(before.attempts[-1].at + 1, tag=None)

        h.cfg["providers"][0]["api"] = h.api
        assert await h.reload()
        after = await h.lose_reply("t1")  # sent under the api: tagged, and noted so
        assert after.tagged == kind and tag_of(h.last_received(), kind) == "acme:t1"
        h.other_acceptance(after.attempts[-1].at + 30)  # the ingestion proof, for both

        h.clock.t += 2 * MINUTE + 1
        await h.rounds(10, 5 * MINUTE)  # 47 minutes; SendGrid is asked about one record a round
        # Past absent_after, with the proof: t1 is absent; u1 never is, though asked.
        await h.record("t1", State.DEFERRED)
        searched = " ".join(str(r.query) for r in fake.requests)
        assert "acme:u1" in searched and "acme:t1" in searched
        held = await h.record("u1", State.UNKNOWN)
        assert [a.actor for a in held.audit if a.actor.startswith("verdict:")] == []
        # `smtpguard verdict` asks the same way, and says why no absence can settle it.
        code, out = await cli(capsys, "verdict", "acme", "u1", "-c", str(h.path))
        assert code == 3 and "verdict: none yet; the record is unknown" in out
        assert (
            "absence proves nothing here: the message is not known to have gone to this log of primary" in out
        )

        # Past give_up the loop leaves it to an operator; the retry is held, never sent.
        h.clock.t += 24 * 3600
        await h.loop.round()
        await h.record("u1", State.UNKNOWN)
        retried = await send(h.guard.ports[0], message("u1"))
        assert retried.code == 451 and "unknown" in retried.text
        upstream.handler.script = []
        resent = await send(h.guard.ports[0], message("t1"))
        assert resent.code == 250 and "duplicate" not in resent.text
    # u1 once (the copy the provider took, never sent again); t1's lost copy and its resend
    assert upstream.event_keys() == ["u1", "t1", "t1"]


async def test_mailgun_finds_a_message_sent_before_its_api_by_the_message_id(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mailgun's log is searched by the Message-ID every relayed message carries: a message
    sent before the tag was written is still found, and settles."""
    async with verdict_harness(tmp, upstream, store_url, monkeypatch, api=False) as h:
        rec = await h.lose_reply("m1")
        assert rec.tagged is None and tag_of(h.last_received(), "mailgun") is None
        fake = h.fake
        assert isinstance(fake, FakeMailgun)
        fake.add("accepted", rec.attempts[-1].at + 1, message_id=message_id_of(h.last_received()))
        h.cfg["providers"][0]["api"] = h.api
        assert await h.reload()
        h.clock.t += 2 * MINUTE + 1

        async def settled() -> State:
            # This round, or serve's own loop started by the reload: whichever asks first.
            await h.loop.round()
            return (await h.record("m1")).state

        final = await eventually(settled, lambda state: state is State.DELIVERED, timeout=30, interval=0.05)
        assert final is State.DELIVERED
        assert fake.requests and all(
            r.query.get("message-id") for r in fake.requests if r.path.endswith("/events")
        )
        await h.record("m1", State.DELIVERED)
        dup = await send(h.guard.ports[0], message("m1"))
        assert dup.code == 250 and "duplicate" in dup.text
    assert upstream.event_keys() == ["m1"]
