"""`smtpguard verdict ZONE KEY` (DESIGN.md §19): asks now, settles as the loop would, prints
what the log said. A real guard leaves the records unknown (the upstream takes the dot and
drops before its 250); the command runs against the same store and a local fake log API,
on the store's real clock."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from smtpguard.policy.ledger import State
from smtpguard.server import Server
from tests.support import Behaviour, Upstream, message, running_guard, send, write_config
from tests.support.cli import cli
from tests.support.provider_api_fakes import FakeMailgun
from tests.support.verdicts import API_ENV, API_KEY, MAILGUN_DOMAIN, message_id_of, tag_of, verdict_config


@contextlib.asynccontextmanager
async def guard_and_log(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Server, FakeMailgun, str]]:
    """A guard whose provider's log is a local fake Mailgun; the path of its config file."""
    monkeypatch.setenv(API_ENV, API_KEY)
    fake = FakeMailgun(API_KEY, MAILGUN_DOMAIN)
    await fake.start()
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "mailgun", fake.base_url)
        c = str(write_config(tmp / "c.yaml", cfg))
        async with running_guard(cfg) as guard:
            assert guard.store is not None
            yield guard, fake, c
    finally:
        await fake.stop()


async def test_verdict_asks_now_settles_and_prints_the_log(
    tmp: Path,
    upstream: Upstream,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with guard_and_log(tmp, upstream, store_url, monkeypatch) as (guard, fake, c):
        assert guard.store is not None
        upstream.handler.script = [Behaviour(drop_after_dot=True), Behaviour(drop_after_dot=True)]
        for key in ("v1", "v2"):
            assert (await send(guard.ports[0], message(key))).code == 451
        v1 = upstream.received[0]
        rec = await guard.store.get("acme", "v1")
        assert rec is not None
        fake.add("accepted", rec.attempts[-1].at + 1, message_id=message_id_of(v1), tag=tag_of(v1, "mailgun"))

        code, doc = await cli(capsys, "verdict", "acme", "v1", "--json", "-c", c)
        assert code == 0 and (doc["verdict"], doc["state"], doc["settled"]) == (
            "accepted",
            "delivered",
            True,
        )
        assert [e["kind"] for e in doc["log"]] == ["accepted"] and doc["log"][0]["tag"] == "acme:v1"
        again = await send(guard.ports[0], message("v1"))
        assert again.code == 250 and "duplicate" in again.text

        # settled now: printed with its state and left alone
        code, out = await cli(capsys, "verdict", "acme", "v1", "-c", c)
        assert code == 0 and out.strip() == "acme v1: delivered (not unknown; left alone)"

        # nothing in the log yet: none yet, exit 3, still unknown
        code, out = await cli(capsys, "verdict", "acme", "v2", "-c", c)
        assert code == 3
        assert "log: nothing about this message" in out and "verdict: none yet; the record is unknown" in out
        v2 = await guard.store.get("acme", "v2")
        assert v2 is not None and v2.state is State.UNKNOWN

        # the API refusing the key: none yet, exit 3, the key never printed
        monkeypatch.setenv(API_ENV, "wrong-key")
        code, out = await cli(capsys, "verdict", "acme", "v2", "-c", c)
        assert code == 3 and "could not be read" in out and "wrong-key" not in out

        code, _ = await cli(capsys, "verdict", "acme", "nope", "-c", c)
        assert code == 3
        code, _ = await cli(capsys, "verdict", "nozone", "v1", "-c", c)
        assert code == 1
        # each command's store connection is closed: the guard's own still serves
        assert await guard.store.get("acme", "v2") is not None
    assert upstream.event_keys() == ["v1", "v2"]


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
async def test_what_the_log_says_is_printed_without_terminal_controls(
    tmp: Path,
    upstream: Upstream,
    store_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The log's text is the provider's (a reason) or any sender's (a Message-ID): printed
    to an operator's terminal, an escape sequence in it would rewrite what they read."""
    async with guard_and_log(tmp, upstream, store_url, monkeypatch) as (guard, fake, c):
        assert guard.store is not None
        upstream.handler.script = [Behaviour(drop_after_dot=True)]
        assert (await send(guard.ports[0], message("t1"))).code == 451
        got = upstream.received[0]
        rec = await guard.store.get("acme", "t1")
        assert rec is not None
        hostile = "\x1b[2J\x1b]0;owned\x07verdict: accepted\r"
        at = rec.attempts[-1].at + 1
        tag = tag_of(got, "mailgun")
        fake.add("rejected", at, message_id=message_id_of(got), tag=tag, reason=hostile)
        code, out = await cli(capsys, "verdict", "acme", "t1", "-c", c)
        assert code == 0 and "verdict: refused; the record is failed" in out, out
        assert not [ch for ch in out if (ord(ch) < 32 and ch != "\n") or 127 <= ord(ch) < 160], repr(out)
    assert upstream.event_keys() == ["t1"]
