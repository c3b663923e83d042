"""Hostile report shapes at the events mailbox, which is an MX: anyone can mail it.

A report names at most as many recipients as a message may have (DESIGN.md §18: an
unverified report lands in a record's history *at most*). One DSN quoting a Message-ID its
sender had seen, naming thousands of recipients, wrote one history row each (5,000 rows
and 8 s of store work for 400 KB). A report nested a thousand parts deep made the parser
recurse out of stack. A real SMTP client mails the reports; rows are counted in the store."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from smtpguard.events import mailbox as mailbox_module
from smtpguard.events.reports import read_report
from smtpguard.server import Server
from tests.events.test_events import RCPT, sent, suppressed
from tests.events.test_events_mailbox import (
    bounce_address,
    deliver,
    dsn,
    mailbox_config,
    verp_secret,  # noqa: F401 - the fixture, autouse here too
)
from tests.support import Upstream, base_config, message, running_guard, send

LIMIT = 5
"""limits.max_recipients: no message smtpguard relayed had more recipients than this."""


def naming(headers: str, strangers: int, last: str = RCPT) -> bytes:
    """A DSN with a block for each of `strangers` addresses, then one for `last`."""
    raw = dsn(headers, to=last).decode()
    block = "Final-Recipient: rfc822; stranger{i}@example.org\r\nAction: failed\r\nStatus: 5.1.1\r\n\r\n"
    blocks = "".join(block.format(i=i) for i in range(strangers))
    return raw.replace("Final-Recipient:", blocks + "Final-Recipient:", 1).encode()


async def _history(guard: Server, key: str) -> list[tuple[str | None, str]]:
    assert guard.store is not None
    return [(e.recipient, e.effect) for e in await guard.store.provider_events("acme", key)]


async def test_a_forged_report_naming_thousands_of_recipients_writes_at_most_a_messages_worth(
    tmp: Path, upstream: Upstream
) -> None:
    cfg = base_config(tmp, upstream.port, events={"mailbox": mailbox_config()}, limits__max_recipients=LIMIT)
    async with running_guard(cfg) as guard:
        message_id, _ = await sent(guard, upstream, "invoice:1")
        quoted = f"From: billing@acme.example\r\nMessage-ID: {message_id}\r\nSubject: x"
        assert (await deliver(guard, naming(quoted, 2000)))[0] == 250
        rows = await _history(guard, "invoice:1")
        assert len(rows) == LIMIT, len(rows)
        assert {effect for _, effect in rows} == {"unverified"}
        assert await suppressed(guard, "acme") == {}
        # A genuine report at the message's token is still read, within the same bound.
        headers = upstream.received[0].content.split(b"\r\n\r\n", 1)[0].decode()
        assert (await deliver(guard, naming(headers, LIMIT - 1), bounce_address(upstream)))[0] == 250
        assert await suppressed(guard, "acme") == {RCPT: "bounce 5.1.1 via mailbox"}
        assert len(await _history(guard, "invoice:1")) == 2 * LIMIT
        reply = await send(guard.ports[0], message("invoice:2", to=RCPT), recipients=[RCPT])
        assert reply.code == 550, reply
        assert len(upstream.received) == 1


def nested(depth: int) -> bytes:
    """A multipart/report whose first part is a multipart, whose first part is one, …"""
    head = b"From: x@mx.example\r\nContent-Type: multipart/report; report-type=delivery-status; "
    head += b'boundary="b0"\r\n\r\n'
    parts = [
        f'--b{i}\r\nContent-Type: multipart/mixed; boundary="b{i + 1}"\r\n\r\n'.encode() for i in range(depth)
    ]
    tail = b"".join(f"\r\n--b{i}--\r\n".encode() for i in reversed(range(depth + 1)))
    return head + b"".join(parts) + tail


async def test_a_report_nested_a_thousand_parts_deep_is_not_a_report_and_no_traceback(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    # 70 KB: Python's email parser recursed once per level and raised RecursionError, which
    # the SMTP server answered "500 Error: (RecursionError) …" with a traceback in the log.
    cfg = base_config(tmp, upstream.port, events={"mailbox": mailbox_config()})
    async with running_guard(cfg) as guard:
        caplog.set_level(logging.INFO)
        code, text = await deliver(guard, nested(1000))
        assert (code, text) == (250, "2.0.0 accepted (not a delivery or feedback report)"), (code, text)
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
        # The listener goes on reading reports.
        message_id, _ = await sent(guard, upstream, "invoice:1")
        quoted = f"From: billing@acme.example\r\nMessage-ID: {message_id}\r\nSubject: x"
        assert (await deliver(guard, naming(quoted, 0)))[0] == 250
        assert len(await _history(guard, "invoice:1")) == 1


async def test_reading_a_megabyte_report_leaves_the_event_loop_free(
    tmp: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parsing 1 MB of MIME takes a few hundred ms of CPU; on the event loop it stopped every
    # listener of the process (submissions, webhooks) that long, per report, from anyone.
    # What is asserted is where the parse runs and that the loop kept turning meanwhile, not
    # how long anything took (timings belong in bench/: this machine is shared).
    raw = naming("From: a@b.example\r\nMessage-ID: <x@y.example>", 12_000)
    assert len(raw) > 1_000_000
    parses: list[tuple[int, float, float]] = []

    def watched(*args: Any) -> Any:
        began = time.monotonic()
        try:
            return read_report(*args)
        finally:
            parses.append((threading.get_ident(), began, time.monotonic()))

    monkeypatch.setattr(mailbox_module, "read_report", watched)
    box = {**mailbox_config(), "max_message_size": "2MB"}
    cfg = base_config(tmp, upstream.port, events={"mailbox": box}, limits__max_recipients=LIMIT)
    async with running_guard(cfg) as guard:
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                await asyncio.sleep(0.005)
                ticks.append(time.monotonic())

        ticker = asyncio.create_task(tick())
        try:
            assert (await deliver(guard, raw))[0] == 250
        finally:
            ticker.cancel()
    assert len(parses) == 1, parses
    thread, began, ended = parses[0]
    assert thread != threading.get_ident(), "the report was parsed on the event loop's thread"
    assert any(began < t < ended for t in ticks), "the event loop did not turn while the report was parsed"
