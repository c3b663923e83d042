"""Store-and-forward, a stale note attacked: an entry lost under SendGrid's api (noted
`tagged`), judged not accepted and re-queued; a reload takes the api away before the worker
claims it again, so its second copy goes out untagged and is lost too; the api comes back.
The claim cleared the first attempt's `tagged`: the second copy is never judged absent from
a search by the tag it never carried. A real client, listener, upstream sink, store, queue
worker and fake SendGrid log; the clock is injected. The upstream is counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from tests.support import Behaviour, Upstream, message, send
from tests.support.eventually import eventually
from tests.support.verdicts import MINUTE, QUEUED, tag_of, verdict_harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


async def test_a_requeued_entry_sent_untagged_is_never_judged_absent(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with verdict_harness(tmp, upstream, store_url, monkeypatch, "sendgrid", **QUEUED) as h:
        upstream.handler.script = [Behaviour(drop_after_dot=True), Behaviour(drop_after_dot=True)]
        assert (await send(h.guard.ports[0], message("q1"))).code == 250
        first = await eventually(
            lambda: h.record("q1"), lambda r: r.state is State.UNKNOWN, timeout=15, interval=0.05
        )
        assert first.tagged == "sendgrid" and tag_of(upstream.received[-1], "sendgrid") == "acme:q1"
        h.other_acceptance(first.attempts[-1].at + 30)  # SendGrid never took the first copy
        h.clock.t += 2 * MINUTE + 1
        for _ in range(40):
            await h.loop.round()
            if (await h.record("q1")).state is not State.UNKNOWN:
                break
            h.clock.t += 2 * MINUTE
        await h.record("q1", State.DEFERRED)  # not accepted: re-queued

        del h.cfg["providers"][0]["api"]
        assert await h.reload()
        h.clock.t += 2 * MINUTE  # past min_retry_interval: the worker sends it again
        second = await eventually(
            lambda: h.record("q1"),
            lambda r: r.state is State.UNKNOWN and r.sg_id != first.sg_id,
            timeout=15,
            interval=0.05,
        )
        assert second.tagged is None and tag_of(upstream.received[-1], "sendgrid") is None

        h.cfg["providers"][0]["api"] = h.api
        assert await h.reload()
        h.other_acceptance(second.attempts[-1].at + 30)
        h.clock.t += 2 * MINUTE + 1
        await h.rounds(40, 2 * MINUTE)
        assert any("acme:q1" in str(r.query) for r in h.fake.requests)
        await h.record("q1", State.UNKNOWN)
        store = h.guard.store
        assert store is not None  # the entry is kept, held with its record
        assert [e.key for e in await store.queue_entries("acme") if e.key == "q1"] == ["q1"]
    # the copy SendGrid never took, and the untagged one held for an operator: never a third
    assert upstream.event_keys() == ["q1", "q1"]
