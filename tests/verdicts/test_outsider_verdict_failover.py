"""Failover between a provider that writes a tag and one that does not (DESIGN.md §6, §19):
the data_sent note is written again for the provider the DATA goes to, so the record names
the standby and the tag it wrote (or none), never the primary's that refused at MAIL. A real
client, listener, two upstream sinks, store and fake SendGrid log; the clock is injected.
Each sink is counted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from smtpguard.policy.ledger import State
from tests.relay.test_resilience import upstream_on
from tests.support import Behaviour, Upstream, message, send
from tests.support.verdicts import MINUTE, tag_of, verdict_harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


def _with_standby(port: int, tagged: str) -> Callable[[dict[str, Any]], None]:
    """A second provider, `standby`, on `port`; the api on `tagged` of the two alone."""

    def configure(cfg: dict[str, Any]) -> None:
        second = {**cfg["providers"][0], "name": "standby", "port": port}
        api = cfg["providers"][0].pop("api")
        second.pop("api", None)
        (cfg["providers"][0] if tagged == "primary" else second)["api"] = api
        cfg["providers"].append(second)

    return configure


@pytest.mark.parametrize("tagged", ["primary", "standby"])
async def test_the_note_names_the_provider_the_data_went_to_and_its_tag(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, tagged: str
) -> None:
    async with (
        upstream_on() as standby,
        verdict_harness(
            tmp, upstream, store_url, monkeypatch, "sendgrid", configure=_with_standby(standby.port, tagged)
        ) as h,
    ):
        upstream.handler.script = [Behaviour(mail="451 4.3.0 try later")]
        standby.handler.script = [Behaviour(drop_after_dot=True)]
        lost = await send(h.guard.ports[0], message("k1"))
        assert lost.code == 451 and "unknown" in lost.text
        rec = await h.record("k1", State.UNKNOWN)
        assert rec.via == "standby"
        assert rec.tagged == (None if tagged == "primary" else "sendgrid")
        assert tag_of(standby.received[-1], "sendgrid") == (None if tagged == "primary" else "acme:k1")
        if tagged == "standby":
            h.log(standby.received[-1], rec.attempts[-1].at + 1)
        h.other_acceptance(rec.attempts[-1].at + 30)
        h.clock.t += 2 * MINUTE + 1
        await h.rounds(40, 2 * MINUTE)
        if tagged == "primary":
            # The standby has no api: nobody asks, nothing is judged absent.
            assert not any("acme:k1" in str(r.query) for r in h.fake.requests)
            await h.record("k1", State.UNKNOWN)
            again = await send(h.guard.ports[0], message("k1"))
            assert again.code == 451 and "unknown" in again.text
        else:
            await h.record("k1", State.DELIVERED)
            again = await send(h.guard.ports[0], message("k1"))
            assert again.code == 250 and "duplicate" in again.text
    assert upstream.received == []  # refused at MAIL: nothing reached the primary
    assert standby.event_keys() == ["k1"]
