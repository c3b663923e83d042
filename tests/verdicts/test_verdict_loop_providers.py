"""The verdict loop in `serve` with two providers (DESIGN.md §19): one provider's log API
hangs (every answer stalls past the client's timeout), the other's answers. The hung one's
look is bounded by its timeouts, and the other provider's records are still asked about at
their own pace meanwhile, not after the hung round has run out. A real guard running its own
loop, real client, store and upstream sink, two local fakes over real HTTP; the loop's clock
is injected, the rounds are the loop's own (its real-time tick made short)."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from smtpguard.store import Store
from smtpguard.verdicts import loop as verdict_loop
from tests.support import (
    OTHER_PASSWORD,
    Behaviour,
    FakeClock,
    Upstream,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.eventually import eventually
from tests.support.provider_api_fakes import FakeMailgun
from tests.support.verdicts import (
    API_ENV,
    API_KEY,
    MAILGUN_DOMAIN,
    api_section,
    message_id_of,
    tag_of,
    verdict_config,
)

MINUTE = 60.0


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
async def test_a_hung_api_holds_no_other_providers_verdicts(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    monkeypatch.setattr(verdict_loop, "TICK", 0.1)
    clock = FakeClock()
    hung, fine = FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock), FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock)
    await hung.start()
    await fine.start()
    hung.stall = 60.0
    cfg = verdict_config(tmp, upstream.port, store_url, "mailgun", hung.base_url)
    cfg["providers"][0]["api"]["timeout"] = "3s"  # a hung look: 4 requests of 3 s and backoffs
    standby = {**cfg["providers"][0], "name": "standby", "api": api_section("mailgun", fine.base_url)}
    cfg["providers"].append(standby)
    cfg["zones"]["acme"]["providers"] = ["primary"]
    cfg["zones"]["globex"]["providers"] = ["standby"]
    try:
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            store = guard.store
            assert store is not None
            upstream.handler.script = [Behaviour(drop_after_dot=True)]
            assert (await send(guard.ports[0], message("h1"))).code == 451
            clock.t += 2 * MINUTE + 1
            assert await eventually(lambda: _count(hung), lambda n: n >= 1, timeout=10, interval=0.05)
            # The primary's look now hangs. A standby message's reply is lost, and the
            # standby's log shows it taken.
            upstream.handler.script = [Behaviour(drop_after_dot=True)]
            sender = "billing@globex.example"
            globex = message("g1", sender=sender)
            lost = await send(
                guard.ports[0], globex, user="globex-app", password=OTHER_PASSWORD, sender=sender
            )
            assert lost.code == 451, lost
            rec = await store.get("globex", "g1")
            assert rec is not None and rec.state is State.UNKNOWN and rec.via == "standby"
            got = upstream.received[-1]
            tag = tag_of(got, "mailgun")
            fine.add("accepted", rec.attempts[-1].at + 1, message_id=message_id_of(got), tag=tag)
            clock.t += 2 * MINUTE + 1
            assert await delivered_soon(store, "globex", "g1"), "held by the hung api"
            held = await store.get("acme", "h1")
            assert held is not None and held.state is State.UNKNOWN
            # SIGHUP points the primary at a log that answers (and has h1): the hung round
            # gives way to the new settings at the next tick, not when it runs out.
            h1 = next(r for r in upstream.received if r.header("X-Event-Key") == "h1")
            tag = tag_of(h1, "mailgun")
            fine.add("accepted", held.attempts[-1].at + 1, message_id=message_id_of(h1), tag=tag)
            cfg["providers"][0]["api"] = api_section("mailgun", fine.base_url)
            write_config(path, cfg)
            assert await guard.reload()
            clock.t += 6 * MINUTE
            assert await delivered_soon(store, "acme", "h1"), "the hung round held the reload"
    finally:
        await hung.stop()
        await fine.stop()
    assert sorted(k for k in upstream.event_keys() if k) == ["g1", "h1"]


async def _count(fake: FakeMailgun) -> int:
    return len(fake.requests)


async def delivered_soon(store: Store, zone: str, key: str) -> bool:
    """Settled `delivered` within 5 s: a few of the loop's ticks, far less than a hung look."""
    rec = await eventually(
        lambda: store.get(zone, key),
        lambda r: r is not None and r.state is State.DELIVERED,
        timeout=5,
        interval=0.05,
    )
    return rec is not None and rec.state is State.DELIVERED
