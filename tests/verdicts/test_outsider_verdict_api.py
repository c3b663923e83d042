"""An outsider's provider log API (DESIGN.md §19): one that redirects to another host, or
trickles its body for ever. A real local HTTP server plays each; what reached the other host,
what the client raised and how long it took are counted. The worst case is a verdict resting
on another host's answer, or the API key sent to it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from smtpguard.policy.verdicts import Attempt
from smtpguard.verdicts.http import ApiMalformed, ApiUnavailable
from smtpguard.verdicts.mailgun import MailgunLog
from smtpguard.verdicts.model import LogApi
from smtpguard.verdicts.postmark import PostmarkLog
from smtpguard.verdicts.sendgrid import SendgridLog
from tests.support.provider_api_fakes import FakeApi, FakeMailgun, FakePostmark, FakeSendgrid
from tests.verdicts.test_verdict_clients import FAST, KEY, Now, judge

DOMAIN = "mg.acme.example"


@contextlib.asynccontextmanager
async def serving(handler: Callable[[web.Request], Any]) -> AsyncIterator[str]:
    """A real HTTP server on loopback answering every GET with `handler`; its base URL."""
    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def client(kind: str, base_url: str, now: Now, **kw: Any) -> LogApi:
    common: dict[str, Any] = {
        "provider": "primary",
        "base_url": base_url,
        "key": KEY,
        "wall": now,
        "retry": FAST,
    }
    if kind == "mailgun":
        return MailgunLog(domain=DOMAIN, **common, **kw)
    if kind == "postmark":
        return PostmarkLog(**common, **kw)
    return SendgridLog(**common, **kw)


def elsewhere(kind: str, now: Now) -> FakeApi:
    """The host a redirect points at: a fake of the same API that knows the key, holding the
    message's acceptance, so that following the redirect would both hand it the key and take
    its word for the verdict."""
    if kind == "mailgun":
        mg = FakeMailgun(KEY, DOMAIN, now)
        mg.add("accepted", now.t + 1, message_id="<a@acme.example>", tag="acme:1")
        return mg
    if kind == "postmark":
        pm = FakePostmark(KEY, now)
        pm.add_message(now.t + 1, tag="acme:1")
        return pm
    sg = FakeSendgrid(KEY, now)
    sg.add_message(now.t + 1, tag="acme:1")
    return sg


@pytest.mark.parametrize("kind", ["mailgun", "postmark", "sendgrid"])
@pytest.mark.parametrize("status", [301, 302, 307, 308])
async def test_a_redirect_to_another_host_is_not_followed(kind: str, status: int) -> None:
    now = Now()
    other = elsewhere(kind, now)
    await other.start()

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": f"{other.base_url}{request.path_qs}"})

    try:
        async with serving(redirect) as base, client(kind, base, now) as api:
            attempt = Attempt("primary", now.t, "acme:1", "<a@acme.example>")
            with pytest.raises(ApiMalformed, match="redirect"):
                await judge(api, attempt, now.t + 3600)
    finally:
        await other.stop()
    print(
        f"{kind} {status}: requests at the other host={len(other.requests)} "
        f"carrying the key={sum(r.authorised for r in other.requests)}"
    )
    assert other.requests == []


async def test_a_body_trickled_for_ever_ends_at_the_timeout() -> None:
    now = Now()
    written = {"bytes": 0}

    async def trickle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"items": [')
        with contextlib.suppress(ConnectionError):
            while True:
                await resp.write(b" ")
                written["bytes"] += 1
                await asyncio.sleep(0.05)
        return resp

    async with serving(trickle) as base, client("mailgun", base, now, timeout=0.5) as api:
        started = time.monotonic()
        with pytest.raises(ApiUnavailable, match=r"after 4 requests \(TimeoutError\)"):
            await asyncio.wait_for(api.entries(Attempt("primary", now.t, "acme:1", "<a@x>")), 30)
        took = time.monotonic() - started
    print(f"trickle: took={took:.2f}s bytes written={written['bytes']}")
    assert took < 10


@pytest.mark.parametrize("stamp", [float("nan"), float("inf"), 10**400], ids=["NaN", "Infinity", "huge-int"])
async def test_a_time_that_is_no_number_is_unreadable_not_another_message(stamp: Any) -> None:
    """The log holds the message's acceptance with a time JSON can spell but that is no
    instant (NaN, Infinity, an integer past any float). Dropping that entry silently leaves
    the other message's later acceptance, the proof: `not accepted`, and a second copy."""
    now = Now()
    t = now.t
    lost = Attempt("primary", t, "acme:1", "<a@acme.example>")
    mailgun = FakeMailgun(KEY, DOMAIN, now)
    item = mailgun.add("accepted", t + 1, message_id="<a@acme.example>", tag="acme:1")
    item["timestamp"] = stamp
    mailgun.add("accepted", t + 300, message_id="<d@acme.example>", tag="acme:4")
    postmark = FakePostmark(KEY, now)
    pm = postmark.add_message(t + 1, tag="acme:1")
    pm["ReceivedAt"] = stamp
    postmark.add_message(t + 300, tag="acme:4")
    sendgrid = FakeSendgrid(KEY, now)
    sg = sendgrid.add_message(t + 1, tag="acme:1")
    sg["events"][0]["processed"] = stamp
    sendgrid.add_message(t + 300, tag="acme:4")
    now.t = t + 1800 + 60  # absent_after past the attempt, on every party's clock
    outcomes: dict[str, str] = {}
    fakes: list[tuple[str, FakeApi]] = [("mailgun", mailgun), ("postmark", postmark), ("sendgrid", sendgrid)]
    for kind, fake in fakes:
        await fake.start()
        try:
            async with client(kind, fake.base_url, now) as api:
                try:
                    outcomes[kind] = (await judge(api, lost, now.t)).kind.value
                except ApiMalformed as e:
                    outcomes[kind] = f"malformed: {e}"
        finally:
            await fake.stop()
    print(f"time {stamp!r:.20}: {outcomes}")
    assert all(o.startswith("malformed") and "time" in o for o in outcomes.values()), outcomes
