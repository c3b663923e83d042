"""The webhook listener's trust rules (DESIGN.md §18): Postmark's Basic-auth guesses are
limited per address like SMTP AUTH and each failure is logged without the password; an
event time that is not a real moment near now is 400 naming the field and never reaches
the history; a body the client abandons is one log line, not a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from smtpguard.console.views import iso
from smtpguard.server import Server
from tests.events.test_events import RCPT, events_port, sent, suppressed
from tests.support import PASSWORD, Upstream, base_config, message, password_hash, running_guard, send
from tests.support import events as ev
from tests.support.console import Operator
from tests.support.eventually import eventually

GUESSES = 300
YEAR = 366 * 86400


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream, keys: ev.Keys) -> AsyncIterator[Server]:
    cfg = base_config(
        tmp,
        upstream.port,
        events={"address": "127.0.0.1:0", "sources": keys.sources()},
        console={
            "address": "127.0.0.1:0",
            "operators": [
                {"username": "alice", "password_hash": password_hash("alice-pass-1"), "role": "operator"}
            ],
        },
    )
    async with running_guard(cfg) as server:
        yield server


async def post_from(
    source_ip: str, port: int, name: str, signed: ev.Signed, session: aiohttp.ClientSession | None = None
) -> tuple[int, dict[str, Any]]:
    async def go(s: aiohttp.ClientSession) -> tuple[int, dict[str, Any]]:
        async with s.post(
            f"http://127.0.0.1:{port}/events/{name}", data=signed.body, headers=signed.headers
        ) as r:
            return r.status, await r.json(content_type=None)

    if session is not None:
        return await go(session)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(source_ip, 0))) as s:
        return await go(s)


# --- Postmark's Basic auth ----------------------------------------------------------------------
async def test_postmark_password_guesses_are_limited_per_address_and_logged(
    guard: Server, upstream: Upstream, keys: ev.Keys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = events_port(guard)
    message_id, queue_id = await sent(guard, upstream, "invoice:acme:guessed")
    guesses = [
        ev.postmark(keys, ev.postmark_bounce(RCPT, queue_id), password=f"guess-{i:04d}")
        for i in range(GUESSES)
    ]
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.20", 0), limit=20)
    async with aiohttp.ClientSession(connector=connector) as s:
        results = await asyncio.gather(*(post_from("", port, "postmark", g, s) for g in guesses))
    statuses = [status for status, _ in results]
    # limits.auth_failures (5) wrong passwords are answered 401; every later guess 429.
    assert statuses.count(401) == 5, (statuses.count(401), statuses.count(429))
    assert statuses.count(429) == GUESSES - 5
    failures = [
        r for r in caplog.records if r.getMessage() == "provider event refused: HTTP Basic credentials"
    ]
    assert len(failures) == 5
    assert all(getattr(r, "client_ip", None) == "127.0.0.20" for r in failures)
    # The 295 refused at the limit are counted, not logged one by one: a guesser sending
    # as fast as it can must not turn into as many log lines.
    assert sum("provider event refused" in m for m in caplog.messages) == 5
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "guess-0" not in logged and keys.postmark not in logged
    assert await suppressed(guard, "acme") == {}

    # Another address (Postmark's own) is not locked out: the genuine webhook applies.
    status, doc = await post_from(
        "127.0.0.21", port, "postmark", ev.postmark(keys, ev.postmark_bounce(RCPT, queue_id))
    )
    assert (status, doc.get("applied")) == (200, 1), doc
    assert RCPT in await suppressed(guard, "acme")
    # Nor are SMTP clients of the guessing address: webhook guesses have a count of their own.
    assert (await send(guard.ports[0], message("invoice:acme:after"), password=PASSWORD)).code == 250
    assert [m.header("X-Event-Key") for m in upstream.received] == [
        "invoice:acme:guessed",
        "invoice:acme:after",
    ]
    del message_id


# --- event times -------------------------------------------------------------------------------
def _postmark_with_time(keys: ev.Keys, queue_id: str, raw_time: str) -> ev.Signed:
    payload = ev.postmark_bounce(RCPT, queue_id)
    payload["BouncedAt"] = "@TIME@"
    body = json.dumps(payload).replace('"@TIME@"', raw_time).encode()
    return ev.Signed(body, ev.postmark(keys, payload).headers)


BAD_TIMES = {
    "overflow": ("1e400", "BouncedAt is not a finite time"),
    "negative overflow": ("-1e400", "BouncedAt is not a finite time"),
    "not a number": ("NaN", "BouncedAt is not a finite time"),
    "two years ahead": (str(time.time() + 2 * YEAR), "BouncedAt is more than a year from now"),
    "two years back": (str(time.time() - 2 * YEAR), "BouncedAt is more than a year from now"),
    "year 9999": ('"9999-12-31T23:59:59Z"', "BouncedAt is more than a year from now"),
    "year 0": ('"0000-01-01T00:00:00Z"', "BouncedAt '0000-01-01T00:00:00Z' is not a number"),
}


@pytest.mark.parametrize("case", list(BAD_TIMES))
async def test_an_implausible_event_time_is_400_naming_the_field(
    guard: Server, upstream: Upstream, keys: ev.Keys, case: str
) -> None:
    raw, reason = BAD_TIMES[case]
    _, queue_id = await sent(guard, upstream, "invoice:acme:timed")
    status, doc = await ev.post(events_port(guard), "postmark", _postmark_with_time(keys, queue_id, raw))
    assert status == 400, doc
    assert reason in doc["error"], doc
    assert await suppressed(guard, "acme") == {}
    assert guard.store is not None
    assert await guard.store.provider_events("acme", "invoice:acme:timed") == []


async def test_the_history_page_shows_a_record_whose_event_time_was_refused(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    """`1e400` made the console's history page answer 500; now the event is refused and
    the page (and a good event's time) renders."""
    _, queue_id = await sent(guard, upstream, "invoice:acme:page")
    port = events_port(guard)
    assert (await ev.post(port, "postmark", _postmark_with_time(keys, queue_id, "1e400")))[0] == 400
    good = ev.postmark_record("Delivery", RCPT, queue_id)
    assert (await ev.post(port, "postmark", ev.postmark(keys, good)))[0] == 200
    assert guard.console is not None
    op = Operator(guard.console.port)
    try:
        await op.login("alice", "alice-pass-1")
        page = await op.get("/events/acme/invoice%3Aacme%3Apage")
    finally:
        await op.close()
    assert page.status == 200, page.text[:500]
    assert "Delivery" in page.text and "invalid time" not in page.text
    assert guard.store is not None
    stored = await guard.store.provider_events("acme", "invoice:acme:page")
    assert [e.provider_type for e in stored] == ["Delivery"]
    assert abs(stored[0].at - time.time()) < 60


# --- an abandoned body ---------------------------------------------------------------------------
async def test_a_body_abandoned_mid_way_is_one_log_line(
    guard: Server, keys: ev.Keys, caplog: pytest.LogCaptureFixture, no_tracebacks: None
) -> None:
    signed = ev.ses(keys, ev.ses_message("Bounce", RCPT, "<m@x>", "Q1"))
    head = (
        f"POST /events/ses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(signed.body)}\r\n\r\n"
    ).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", events_port(guard))
    writer.write(head + signed.body[:100])
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    lines = await eventually(
        lambda: [r for r in caplog.records if r.getMessage() == "provider event body aborted"],
        timeout=5,
        interval=0.1,
    )
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert getattr(lines[0], "source", None) == "ses"
    assert await suppressed(guard, "acme") == {}
    # The listener is unharmed: the whole request is applied (unmatched: no such message).
    status, doc = await ev.post(events_port(guard), "ses", signed)
    assert (status, doc.get("unmatched")) == (200, 1), doc


def test_a_time_stored_before_the_check_renders_instead_of_failing_the_page() -> None:
    """A store written by an earlier release may hold `inf` (or a year past 9999): the
    console shows it as invalid rather than answering 500."""
    assert iso(float("inf")) == "invalid time (inf)"
    assert iso(float("nan")) == "invalid time (nan)"
    assert iso(1e300).startswith("invalid time")
    assert iso(0.0) == "1970-01-01T00:00:00Z"


async def test_postmarks_right_credentials_pass_from_an_address_locked_by_wrong_ones(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    """Postmark sends every customer's webhooks from the same few addresses, with whatever
    Basic credentials each customer put in its webhook URL: any Postmark customer can send
    wrong ones from Postmark's addresses. If that locked the address for everyone, a
    stranger would silence the genuine webhooks for as long as they kept at it."""
    port = events_port(guard)
    _, queue_id = await sent(guard, upstream, "invoice:acme:shared")
    postmark = "127.0.0.30"
    connector = aiohttp.TCPConnector(local_addr=(postmark, 0), limit=4)
    async with aiohttp.ClientSession(connector=connector) as s:
        wrong = [
            await post_from(
                "", port, "postmark", ev.postmark(keys, ev.postmark_bounce(RCPT, queue_id), password=p), s
            )
            for p in ("another-customer-1", "another-customer-2") * 4
        ]
        assert [status for status, _ in wrong] == [401] * 5 + [429] * 3
        status, doc = await post_from(
            "", port, "postmark", ev.postmark(keys, ev.postmark_bounce(RCPT, queue_id)), s
        )
        assert (status, doc.get("applied")) == (200, 1), (status, doc)
        # The wrong ones are still refused: the address stays limited for them.
        again = await post_from(
            "", port, "postmark", ev.postmark(keys, ev.postmark_bounce(RCPT, queue_id), password="x"), s
        )
        assert again[0] == 429
    assert RCPT in await suppressed(guard, "acme")
