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
from tests.support import Behaviour, FakeClock, Upstream, message, running_guard, send, write_config
from tests.support.eventually import eventually
from tests.support.provider_api_fakes import FakeSendgrid
from tests.support.verdicts import API_ENV, API_KEY, tag_of, verdict_config
from tests.verdicts.test_verdict_loop import MINUTE, Harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


async def test_a_requeued_entry_sent_untagged_is_never_judged_absent(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = FakeClock()
    fake = FakeSendgrid(API_KEY, clock)
    await fake.start()
    cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", fake.base_url)
    cfg["zones"]["acme"]["delivery"] = "queue"
    cfg["queue"] = {"poll_interval": "100ms", "backoff": {"base": "1s", "max": "2s"}}
    api = cfg["providers"][0]["api"]
    path = tmp / "c.yaml"
    try:
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            h = Harness(guard, clock, fake, upstream, "sendgrid")
            upstream.handler.script = [Behaviour(drop_after_dot=True), Behaviour(drop_after_dot=True)]
            assert (await send(guard.ports[0], message("q1"))).code == 250
            first = await eventually(
                lambda: h.record("q1"), lambda r: r.state is State.UNKNOWN, timeout=15, interval=0.05
            )
            assert first.tagged == "sendgrid" and tag_of(upstream.received[-1], "sendgrid") == "acme:q1"
            h.other_acceptance(first.attempts[-1].at + 30)  # SendGrid never took the first copy
            clock.t += 2 * MINUTE + 1
            for _ in range(40):
                await h.loop.round()
                if (await h.record("q1")).state is not State.UNKNOWN:
                    break
                clock.t += 2 * MINUTE
            await h.record("q1", State.DEFERRED)  # not accepted: re-queued

            del cfg["providers"][0]["api"]
            write_config(path, cfg)
            assert await guard.reload()
            clock.t += 2 * MINUTE  # past min_retry_interval: the worker sends it again
            second = await eventually(
                lambda: h.record("q1"),
                lambda r: r.state is State.UNKNOWN and r.sg_id != first.sg_id,
                timeout=15,
                interval=0.05,
            )
            assert second.tagged is None and tag_of(upstream.received[-1], "sendgrid") is None

            cfg["providers"][0]["api"] = api
            write_config(path, cfg)
            assert await guard.reload()
            h.other_acceptance(second.attempts[-1].at + 30)
            clock.t += 2 * MINUTE + 1
            for _ in range(40):
                await h.loop.round()
                clock.t += 2 * MINUTE
            assert any("acme:q1" in str(r.query) for r in fake.requests)
            await h.record("q1", State.UNKNOWN)
            store = guard.store
            assert store is not None  # the entry is kept, held with its record
            assert [e.key for e in await store.queue_entries("acme") if e.key == "q1"] == ["q1"]
    finally:
        await fake.stop()
    # the copy SendGrid never took, and the untagged one held for an operator: never a third
    assert upstream.event_keys() == ["q1", "q1"]
