"""A rolling upgrade with verdicts on: the release before the data_sent note named the tag
(40cb517, its tree from `git archive`) and this one share one SQLite store and one SendGrid
log. The earlier release reads a record this one noted (`tagged` is a member it does not
know) and settles it from the log; this one reads a record the earlier release noted (no
`tagged`) and never judges it absent, whatever the log's search by tag finds. A real client,
listener, upstream sink, store and fake log API; this release's clock is injected. Each
test counts what the upstream received."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from tests.support import Behaviour, FakeClock, Upstream, message, send
from tests.support.provider_api_fakes import FakeSendgrid
from tests.support.releases import extract_release, release_cli, release_serving
from tests.support.verdicts import API_ENV, API_KEY, MINUTE, serving, tag_of, verdict_config, verdict_harness

BEFORE = "40cb517"
pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


@pytest.fixture
def before(tmp: Path) -> Iterator[Path]:
    yield extract_release(BEFORE, tmp / "before")


async def test_the_earlier_release_settles_a_record_this_one_noted(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, before: Path
) -> None:
    async with verdict_harness(tmp, upstream, store_url, monkeypatch, "sendgrid") as h:
        rec = await h.lose_reply("f1")
        assert rec.tagged == "sendgrid"
        h.log(h.last_received(), rec.attempts[-1].at + 1)

        done = await release_cli(before, "verdict", "acme", "f1", "-c", str(h.path), "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["verdict"] == "accepted"

        settled = await h.record("f1", State.DELIVERED)
        assert settled.tagged is None  # rewritten by a release that does not know it
        again = await send(h.guard.ports[0], message("f1"))
        assert again.code == 250 and "duplicate" in again.text
    assert upstream.event_keys() == ["f1"]


async def test_a_record_the_earlier_release_noted_is_never_judged_absent_by_this_one(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, before: Path
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)  # the earlier release reads the key too
    clock = FakeClock()
    async with serving(FakeSendgrid(API_KEY, clock)) as fake:
        old_cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", fake.base_url, instance="old")
        async with release_serving(before, old_cfg, tmp) as old_port:
            upstream.handler.script = [Behaviour(drop_after_dot=True)]
            lost = await send(old_port, message("f2"))
            assert lost.code == 451 and "unknown" in lost.text
            # The earlier release wrote the tag, but its note does not say so.
            assert tag_of(upstream.received[-1], "sendgrid") == "acme:f2"
        async with verdict_harness(
            tmp, upstream, store_url, monkeypatch, "sendgrid", clock=clock, fake=fake, instance="new"
        ) as h:
            rec = await h.record("f2", State.UNKNOWN)
            assert rec.tagged is None and rec.via == "primary"
            # The log shows another message's acceptance after it, and nothing of f2 (yet).
            h.other_acceptance(rec.attempts[-1].at + 30)
            clock.t = rec.attempts[-1].at + 2 * MINUTE + 1
            await h.rounds(10, 5 * MINUTE)
            assert any("acme:f2" in str(r.query) for r in fake.requests)
            await h.record("f2", State.UNKNOWN)
            held = await send(h.guard.ports[0], message("f2"))
            assert held.code == 451 and "unknown" in held.text
    assert upstream.event_keys() == ["f2"]
