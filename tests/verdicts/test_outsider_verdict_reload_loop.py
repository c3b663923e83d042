"""The verdict loop a reload starts (DESIGN.md §19: a reload that gives the first provider an
`api` starts it), attacked from outside: a first `api` whose key is missing starts nothing
and breaks nothing; the reload that makes the key readable starts one loop, and every
reload after it keeps that one (never a second loop asking and settling the same records);
the loop started so settles what was lost meanwhile, and stop closes its clients. A real
client, listener, upstream sink, store and fake SendGrid log; the clock is injected. The
upstream is counted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from smtpguard.policy.ledger import State
from tests.support import Behaviour, FakeClock, Upstream, message, send
from tests.support.eventually import eventually
from tests.support.provider_api_fakes import FakeSendgrid
from tests.support.verdicts import API_ENV, API_KEY, MINUTE, api_section, serving, tag_of, verdict_harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


def _loops_running() -> int:
    return sum(
        1
        for t in asyncio.all_tasks()
        if not t.done() and getattr(t.get_coro(), "__qualname__", "") == "VerdictLoop.run"
    )


async def test_reloads_start_one_loop_once_its_key_is_readable(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with verdict_harness(tmp, upstream, store_url, monkeypatch, "sendgrid", api=False) as h:
        # Without an api nothing reads the key; it leaves the environment before the api comes.
        monkeypatch.delenv(API_ENV)
        guard = h.guard
        assert guard.verdicts is None and _loops_running() == 0
        h.cfg["providers"][0]["api"] = h.api
        # The key is not in the environment: the routes take the api's tag, no loop starts.
        assert await h.reload()
        assert guard.verdicts is None and _loops_running() == 0

        rec = await h.lose_reply("r1")
        assert rec.tagged == "sendgrid"
        h.log(h.last_received(), rec.attempts[-1].at + 1)

        monkeypatch.setenv(API_ENV, API_KEY)
        assert await guard.reload()
        loop = guard.verdicts
        assert loop is not None and _loops_running() == 1
        for _ in range(3):
            assert await guard.reload()
            assert guard.verdicts is loop and _loops_running() == 1

        h.clock.t += 2 * MINUTE + 1
        for _ in range(5):
            await loop.round()
            if (await h.record("r1")).state is State.DELIVERED:
                break
            h.clock.t += 5 * MINUTE
        await h.record("r1", State.DELIVERED)
        dup = await send(guard.ports[0], message("r1"))
        assert dup.code == 250 and "duplicate" in dup.text
    assert _loops_running() == 0
    assert all(getattr(c, "_session", None) is None for c in loop.clients.values())
    assert upstream.event_keys() == ["r1"]


def _postmark_instead(cfg: dict[str, Any]) -> None:
    """Postmark's api where SendGrid's was, by the same key."""
    sendgrid_api = cfg["providers"][0]["api"]
    cfg["providers"][0]["api"] = {**sendgrid_api, "kind": "postmark", "token_env": API_ENV}
    del cfg["providers"][0]["api"]["key_env"]


@pytest.mark.parametrize("change", ["added", "kind"])
async def test_a_reload_mid_send_leaves_the_note_naming_the_tag_the_message_carries(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The reload lands while the provider holds MAIL (the data_sent note is being written,
    the message already prepared): the send finishes on the provider object it began on, and
    the note says what that one wrote. `added`: no api before, SendGrid's after — the message
    went untagged and is never judged absent from a search by tag. `kind`: Postmark's before,
    SendGrid's after — the message carries Postmark's tag, which SendGrid's log is not
    searched by."""
    postmark_first = change == "kind"
    async with verdict_harness(
        tmp,
        upstream,
        store_url,
        monkeypatch,
        "sendgrid",
        api=postmark_first,
        configure=_postmark_instead if postmark_first else None,
    ) as h:
        at_mail = asyncio.Event()
        upstream.handler.script = [Behaviour(hold_at_mail=at_mail, drop_after_dot=True)]
        sending = asyncio.create_task(send(h.guard.ports[0], message("m1")))
        try:
            # The provider has MAIL and holds its answer until the reload is in.
            mails = await eventually(
                lambda: upstream.handler.transactions, lambda n: n >= 1, timeout=10, interval=0.01
            )
            assert mails == 1
            h.cfg["providers"][0]["api"] = h.api  # SendGrid's
            assert await h.reload()
        finally:
            at_mail.set()
        lost = await sending
        assert lost.code == 451 and "unknown" in lost.text
        rec = await h.record("m1", State.UNKNOWN)
        carried = {k: tag_of(h.last_received(), k) for k in ("sendgrid", "postmark")}
        assert rec.tagged == (None if change == "added" else "postmark")
        assert carried == {"sendgrid": None, "postmark": None if change == "added" else "acme:m1"}

        h.other_acceptance(rec.attempts[-1].at + 30)  # SendGrid's ingestion proof
        h.clock.t += 2 * MINUTE + 1
        await h.rounds(40, 2 * MINUTE)  # SendGrid: one record a round, rounds 40 s apart
        assert any("acme:m1" in str(r.query) for r in h.fake.requests)
        await h.record("m1", State.UNKNOWN)
        held = await send(h.guard.ports[0], message("m1"))
        assert held.code == 451 and "unknown" in held.text
    assert upstream.event_keys() == ["m1"]


OTHER_ENV = "SMTPGUARD_TEST_OTHER_LOG_API_KEY"


def _other_on_sendgrid(base_url: str) -> Callable[[dict[str, Any]], None]:
    """A second provider, `other`, with SendGrid's api at `base_url` by a key of its own."""

    def configure(cfg: dict[str, Any]) -> None:
        other = {**cfg["providers"][0], "name": "other", "api": api_section("sendgrid", base_url)}
        other["api"]["key_env"] = OTHER_ENV
        cfg["providers"].append(other)

    return configure


@pytest.mark.parametrize("change", ["api-removed", "domain-changed"])
async def test_a_reload_whose_other_key_is_unreadable_never_asks_a_log_the_message_did_not_go_to(
    tmp: Path, upstream: Upstream, store_url: str, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """One reload moves `primary` off the Mailgun domain its log client reads (its api
    removed, or another domain) and names a key for another provider's api that cannot be
    read: the loop keeps its previous clients, and says so. The one it kept for `primary`
    reads a log the messages `primary` sends from then on never reach; the domain is still
    in use (its log shows later acceptances of others), so their absence there would read
    as `not accepted`, and the retry would be the second copy."""
    monkeypatch.setenv(OTHER_ENV, API_KEY)
    clock = FakeClock()
    async with (
        serving(FakeSendgrid(API_KEY, clock)) as sendgrid,
        verdict_harness(
            tmp,
            upstream,
            store_url,
            monkeypatch,
            clock=clock,
            configure=_other_on_sendgrid(sendgrid.base_url),
        ) as h,
    ):
        guard, cfg = h.guard, h.cfg
        assert guard.verdicts is not None and set(guard.verdicts.clients) == {"primary", "other"}
        if change == "api-removed":
            del cfg["providers"][0]["api"]
        else:
            cfg["providers"][0]["api"]["domain"] = "mg2.acme.example"
        cfg["providers"][1]["api"]["key_env"] = "SMTPGUARD_TEST_UNSET_KEY"
        assert await h.reload()

        rec = await h.lose_reply("z1")
        assert rec.via == "primary"
        # Another system's message through the old domain, after z1: the proof of ingestion.
        h.other_acceptance(rec.attempts[-1].at + 30)
        h.clock.t += 2 * MINUTE + 1
        await h.rounds(10, 5 * MINUTE)
        await h.record("z1", State.UNKNOWN)
        held = await send(guard.ports[0], message("z1"))
        assert held.code == 451 and "unknown" in held.text
    assert upstream.event_keys() == ["z1"]  # the copy primary's new provider took, never a second
