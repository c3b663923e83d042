"""A reload that points a provider's `api` at another log of the same kind (another Mailgun
domain; another SendGrid account or Postmark server is another key) while a record of a
message sent through the old one is `unknown`. The message never went to the new log, so it
is absent from it, and the new domain's own traffic is a proof of ingestion: before the
data_sent note named the log, the loop judged it `not accepted` and the retry sent a second
copy. Now only the log the provider's api named when the message went proves it absent;
the new one is asked, and the record waits for what proves its fate."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from tests.support import FakeClock, Upstream, message, send
from tests.support.provider_api_fakes import FakeMailgun
from tests.support.verdicts import API_KEY, MINUTE, serving, verdict_harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


async def test_a_message_sent_through_the_old_domain_is_not_judged_absent_from_the_new_one(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    async with (
        serving(FakeMailgun(API_KEY, "mg2.acme.example", clock)) as new,
        verdict_harness(tmp, upstream, store_url, monkeypatch, clock=clock) as h,
    ):
        rec = await h.lose_reply("d1")
        # The old domain took it (its log says so, but is no longer asked).
        h.log(h.last_received(), rec.attempts[-1].at + 1)
        h.cfg["providers"][0]["api"]["domain"] = "mg2.acme.example"
        h.cfg["providers"][0]["api"]["base_url"] = new.base_url
        assert await h.reload()
        h.fake = new  # the log the loop reads from now on
        h.other_acceptance(rec.attempts[-1].at + 30)  # the new domain's own traffic
        h.clock.t += 2 * MINUTE + 1
        await h.rounds(10, 5 * MINUTE)
        assert new.requests
        await h.record("d1", State.UNKNOWN)
        held = await send(h.guard.ports[0], message("d1"))
        assert held.code == 451 and "unknown" in held.text
    assert upstream.event_keys() == ["d1"]
