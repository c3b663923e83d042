"""A verdict on an outcome left unknown by a lost lease (DESIGN.md §4, §19): the owner noted
data_sent, sent the message, and died (kill -9); nobody noticed until the client's retry came
an hour later. The provider took the message when the owner sent it, not when the loss was
noticed: the log must be read about that time, and its absence proved past it, or the
resend is the second copy. A real listener, client, store and upstream sink; the provider's
log is the local fake over real HTTP; the loop's clock is injected."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy import ledger
from smtpguard.policy.ledger import Proceed, State, Submission
from smtpguard.policy.verdicts import VerdictKind
from smtpguard.verdicts.ask import record_attempt
from tests.support import Behaviour, Upstream, message, send
from tests.support.provider_api_fakes import FakeMailgun
from tests.verdicts.test_verdict_loop import MINUTE, Harness, harness

HOUR = 60 * MINUTE


async def crash_after_data_sent(h: Harness, key: str) -> float:
    """Another instance takes `key`'s retry, notes data_sent and dies as its DATA reaches the
    provider, which takes the message: the log shows it a second later. When it was sent."""
    store = h.guard.store
    assert store is not None
    h.upstream.handler.script = [Behaviour(mail="451 4.3.0 try later")]
    assert (await send(h.guard.ports[0], message(key))).code == 451
    rec = await h.record(key, State.DEFERRED)
    h.clock.t += 2 * MINUTE  # past min_retry_interval
    sub = Submission("acme", key, rec.fingerprint, "crashed-1", "other-host", rec.message_id)
    s = ledger.LedgerSettings(send_timeout=60.0)
    taken = ledger.decide(rec, sub, h.clock.t, s)
    assert isinstance(taken, Proceed)
    assert await store.put(taken.record, rec.version) is None
    noted = ledger.mark_data_sent(taken.record, "crashed-1", h.clock.t, s, provider="primary")
    assert noted is not None
    assert await store.put(noted, taken.record.version) is None
    sent_at = h.clock.t
    attempt = record_attempt(noted)
    assert attempt is not None
    assert isinstance(h.fake, FakeMailgun)
    h.fake.add("accepted", sent_at + 1, message_id=noted.message_id, tag=attempt.tag)
    return sent_at


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
async def test_a_lease_lost_long_before_it_was_noticed_is_judged_at_its_send(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with harness(tmp, upstream, store_url, monkeypatch) as h:
        sent_at = await crash_after_data_sent(h, "l1")
        h.clock.t += HOUR  # the client retries an hour later: the lost lease is noticed now
        held = await send(h.guard.ports[0], message("l1"))
        assert held.code == 451 and "unknown" in held.text
        noticed = h.clock.t
        # The provider goes on taking other messages: the log has ingested past both times.
        for n in range(1, 12):
            h.other_acceptance(noticed + n * 5 * MINUTE)
        seen: list[VerdictKind] = []
        for _ in range(12):
            seen += await h.after(5 * MINUTE)
            rec = await h.record("l1")
            if rec.state is not State.UNKNOWN:
                break
        assert VerdictKind.NOT_ACCEPTED not in seen, f"sent at {sent_at}, the log took it then: {seen}"
        assert rec.state is State.DELIVERED, seen
        again = await send(h.guard.ports[0], message("l1"))
        assert again.code == 250 and "duplicate" in again.text
    # The first attempt was refused at MAIL; the crashed owner's copy went to the provider
    # (its log shows it); smtpguard never sends the event again.
    assert upstream.event_keys() == []
