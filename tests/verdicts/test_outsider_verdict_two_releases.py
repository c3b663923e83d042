"""A rolling upgrade with verdicts on: the release before the data_sent note named the tag
(40cb517, its tree from `git archive`) and this one share one SQLite store and one SendGrid
log. The earlier release reads a record this one noted (`tagged` is a member it does not
know) and settles it from the log; this one reads a record the earlier release noted (no
`tagged`) and never judges it absent, whatever the log's search by tag finds. A real client,
listener, upstream sink, store and fake log API; this release's clock is injected. Each
test counts what the upstream received."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from tests.support import (
    Behaviour,
    FakeClock,
    GuardProcess,
    Upstream,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.provider_api_fakes import FakeSendgrid
from tests.support.releases import extract_release
from tests.support.verdicts import API_ENV, API_KEY, tag_of, verdict_config
from tests.verdicts.test_verdict_loop import MINUTE, Harness

BEFORE = "40cb517"
pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


@pytest.fixture
def before(tmp: Path) -> Iterator[Path]:
    yield extract_release(BEFORE, tmp / "before")


async def _earlier_cli(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The earlier release's CLI, off the event loop: the fake API it asks runs on it."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "smtpguard", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_the_earlier_release_settles_a_record_this_one_noted(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, before: Path
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = FakeClock()
    fake = FakeSendgrid(API_KEY, clock)
    await fake.start()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", fake.base_url)
        path = write_config(tmp / "c.yaml", cfg)
        async with running_guard(cfg, clock=clock) as guard:
            h = Harness(guard, clock, fake, upstream, "sendgrid")
            rec = await h.lose_reply("f1")
            assert rec.tagged == "sendgrid"
            h.log(h.last_received(), rec.attempts[-1].at + 1)

            done = await _earlier_cli(before, "verdict", "acme", "f1", "-c", str(path), "--json")
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["verdict"] == "accepted"

            settled = await h.record("f1", State.DELIVERED)
            assert settled.tagged is None  # rewritten by a release that does not know it
            again = await send(guard.ports[0], message("f1"))
            assert again.code == 250 and "duplicate" in again.text
    finally:
        await fake.stop()
    assert upstream.event_keys() == ["f1"]


async def test_a_record_the_earlier_release_noted_is_never_judged_absent_by_this_one(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, before: Path
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    clock = FakeClock()
    fake = FakeSendgrid(API_KEY, clock)
    await fake.start()
    old_port = free_port()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", fake.base_url, instance="new")
        old_cfg = verdict_config(tmp, upstream.port, store_url, "sendgrid", fake.base_url, instance="old")
        old_cfg["listen"] = [{"address": f"127.0.0.1:{old_port}", "tls": "none"}]
        old = GuardProcess(write_config(tmp / "old.yaml", old_cfg), tmp / "old.log", src=before)
        old.start()
        try:
            await old.wait_port(old_port, timeout=30)
            upstream.handler.script = [Behaviour(drop_after_dot=True)]
            lost = await send(old_port, message("f2"))
            assert lost.code == 451 and "unknown" in lost.text
            # The earlier release wrote the tag, but its note does not say so.
            assert tag_of(upstream.received[-1], "sendgrid") == "acme:f2"
        finally:
            old.stop()
        async with running_guard(cfg, clock=clock) as guard:
            h = Harness(guard, clock, fake, upstream, "sendgrid")
            rec = await h.record("f2", State.UNKNOWN)
            assert rec.tagged is None and rec.via == "primary"
            # The log shows another message's acceptance after it, and nothing of f2 (yet).
            h.other_acceptance(rec.attempts[-1].at + 30)
            clock.t = rec.attempts[-1].at + 2 * MINUTE + 1
            for _ in range(10):
                await h.loop.round()
                clock.t += 5 * MINUTE
            assert any("acme:f2" in str(r.query) for r in fake.requests)
            await h.record("f2", State.UNKNOWN)
            held = await send(guard.ports[0], message("f2"))
            assert held.code == 451 and "unknown" in held.text
    finally:
        await fake.stop()
    assert upstream.event_keys() == ["f2"]
