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
from tests.support import FakeClock, Upstream, message, running_guard, send, write_config
from tests.support.provider_api_fakes import FakeMailgun
from tests.support.verdicts import API_ENV, API_KEY, MAILGUN_DOMAIN, verdict_config
from tests.verdicts.test_verdict_loop import MINUTE, Harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


async def test_a_message_sent_through_the_old_domain_is_not_judged_absent_from_the_new_one(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = FakeClock()
    old = FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock)
    new = FakeMailgun(API_KEY, "mg2.acme.example", clock)
    await old.start()
    await new.start()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "mailgun", old.base_url)
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            h = Harness(guard, clock, new, upstream, "mailgun")
            rec = await h.lose_reply("d1")
            # The old domain took it (its log says so, but is no longer asked).
            Harness(guard, clock, old, upstream, "mailgun").log(h.last_received(), rec.attempts[-1].at + 1)
            cfg["providers"][0]["api"]["domain"] = "mg2.acme.example"
            cfg["providers"][0]["api"]["base_url"] = new.base_url
            write_config(path, cfg)
            assert await guard.reload()
            h.other_acceptance(rec.attempts[-1].at + 30)  # the new domain's own traffic
            clock.t += 2 * MINUTE + 1
            for _ in range(10):
                await h.loop.round()
                clock.t += 5 * MINUTE
            assert new.requests
            await h.record("d1", State.UNKNOWN)
            held = await send(guard.ports[0], message("d1"))
            assert held.code == 451 and "unknown" in held.text
    finally:
        await new.stop()
        await old.stop()
    assert upstream.event_keys() == ["d1"]
