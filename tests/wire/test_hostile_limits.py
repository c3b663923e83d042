"""Resource limits over a real socket: message size, recipients, line length, header block,
connections, idle and DATA timeouts. A client over a limit gets a clear reply; the others keep
being served meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.support import Behaviour, Upstream, base_config, running_guard
from tests.support.eventually import eventually
from tests.support.hostile import (
    RawClient,
    all_released,
    message_bytes,
    nothing_recorded,
    session,
    submit,
    terminated,
)

# Every hostile case must leave no traceback in the logs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_tracebacks")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ConnectionError):
        await task


# --- size ---------------------------------------------------------------------------------------
async def test_size_is_advertised_and_a_declared_size_over_it_is_552_at_mail(
    tmp: Path, upstream: Upstream
) -> None:
    async with (
        running_guard(base_config(tmp, upstream.port, limits__max_message_size="10kB")) as guard,
        session(guard.ports[0]) as c,
    ):
        ehlo = await c.ehlo()
        assert "SIZE 10000" in ehlo.text, ehlo
        over = await c.command("MAIL FROM:<billing@acme.example> SIZE=10001")
        assert (over.code, over.enhanced) == (552, "5.3.4"), over
        assert (await c.command("MAIL FROM:<billing@acme.example> SIZE=9000")).code == 250
    assert upstream.handler.transactions == 0


async def test_data_over_max_message_size_is_552_and_others_are_served(tmp: Path, upstream: Upstream) -> None:
    big = message_bytes("size:1", body=(b"y" * 98 + b"\r\n") * 150)  # ~15 kB
    async with running_guard(base_config(tmp, upstream.port, limits__max_message_size="10kB")) as guard:
        port = guard.ports[0]
        async with session(port) as c:
            await c.command("MAIL FROM:<billing@acme.example>")
            await c.command("RCPT TO:<customer@example.com>")
            c.write(b"DATA\r\n")
            assert (await c.reply()).code == 354
            c.write(terminated(big)[:6000])
            # Another client is served while this one is mid-transfer and over the limit.
            other = await submit(port, message_bytes("size:2"))
            assert other.code == 250, other
            c.write(terminated(big)[6000:])
            reply = await c.reply()
            assert (reply.code, reply.enhanced) == (552, "5.3.4"), reply
            # The session is usable again: the client may send a smaller message.
            assert (await c.command("NOOP")).code == 250
        assert guard.store is not None and await guard.store.get("acme", "size:1") is None
    assert [r.header("X-Event-Key") for r in upstream.received] == ["size:2"]


# --- recipients -------------------------------------------------------------------------------
async def test_recipients_over_the_limit_are_452_and_the_rest_are_sent(tmp: Path, upstream: Upstream) -> None:
    async with (
        running_guard(base_config(tmp, upstream.port, limits__max_recipients=3)) as guard,
        session(guard.ports[0]) as c,
    ):
        await c.command("MAIL FROM:<billing@acme.example>")
        replies = [await c.command(f"RCPT TO:<r{i}@example.com>") for i in range(5)]
        sent = await c.data(terminated(message_bytes("rcpt:1")))
    assert [r.code for r in replies] == [250, 250, 250, 452, 452]
    assert replies[3].enhanced == "4.5.3"
    assert sent.code == 250, sent
    assert len(upstream.received) == 1
    assert upstream.received[0].rcpt_tos == ["r0@example.com", "r1@example.com", "r2@example.com"]


# --- lines and headers ------------------------------------------------------------------------
async def test_data_line_over_max_line_length_is_500(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port, limits__max_line_length=1000)) as guard:
        port = guard.ports[0]
        fits = await submit(port, message_bytes("line:1", body=b"a" * 998 + b"\r\n"))
        over = await submit(port, message_bytes("line:2", body=b"a" * 999 + b"\r\n"))
    assert fits.code == 250, fits
    assert (over.code, over.enhanced) == (500, "5.5.2"), over
    assert [r.header("X-Event-Key") for r in upstream.received] == ["line:1"]


async def test_command_line_over_the_limit_is_500(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        long = await c.command("MAIL FROM:<" + "a" * 1200 + "@acme.example>")
        assert (long.code, long.enhanced) == (500, "5.5.2"), long
        assert (await c.command("RCPT TO:<customer@example.com>")).code == 503
    assert upstream.handler.transactions == 0


async def test_an_endless_data_line_is_discarded_as_it_arrives(tmp: Path, upstream: Upstream) -> None:
    """aiosmtpd alone keeps every fragment of an unterminated line; 64 MB of one line must
    not cost 64 MB of memory, and the client gets 500 5.5.2 once it ends the line."""
    async with running_guard(base_config(tmp, upstream.port)) as guard, session(guard.ports[0]) as c:
        await c.command("MAIL FROM:<billing@acme.example>")
        await c.command("RCPT TO:<customer@example.com>")
        assert (await c.command("DATA")).code == 354
        chunk = b"z" * 2**20
        tracemalloc.start()
        try:
            for _ in range(64):
                c.write(chunk)
                await c.writer.drain()
            c.write(b"\r\n.\r\n")
            reply = await c.reply(timeout=60)
            peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
        finally:
            tracemalloc.stop()
        assert (reply.code, reply.enhanced) == (500, "5.5.2"), reply
        assert peak_mb < 16, f"64 MB in one line took {peak_mb:.0f} MB of memory"
        assert (await c.command("NOOP")).code == 250
    assert upstream.handler.transactions == 0


@pytest.mark.parametrize(
    ("overrides", "extra", "reason"),
    [
        pytest.param(
            {"limits__max_header_size": 2048},
            [b"X-Filler: " + b"f" * 900] * 3,
            "header block exceeds 2048 bytes",
            id="header-block-size",
        ),
        pytest.param(
            {"limits__max_header_count": 10},
            [f"X-Filler-{i}: f".encode() for i in range(10)],
            "more than 10 header fields",
            id="header-count",
        ),
        pytest.param(
            {"limits__max_header_size": 4096},
            [b"X-Folded: start"] + [b"\t" + b"f" * 500] * 10,
            "header block exceeds 4096 bytes",
            id="one-folded-header-over-the-block-size",
        ),
    ],
)
async def test_header_limits_are_550_560(
    tmp: Path, upstream: Upstream, overrides: dict[str, int], extra: list[bytes], reason: str
) -> None:
    async with running_guard(base_config(tmp, upstream.port, **overrides)) as guard:
        reply = await submit(guard.ports[0], message_bytes("headers:1", extra=extra))
        assert await nothing_recorded(guard, "acme", "headers:1")
    assert (reply.code, reply.enhanced) == (550, "5.6.0") and reason in reply.text, reply
    assert upstream.handler.transactions == 0


# --- connections --------------------------------------------------------------------------------
async def test_connections_over_the_per_ip_limit_get_421_and_other_ips_are_served(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(base_config(tmp, upstream.port, limits__max_connections_per_ip=2)) as guard:
        port = guard.ports[0]
        held = [await RawClient.connect(port) for _ in range(2)]
        try:
            for c in held:
                assert (await c.reply()).code == 220
            third = await RawClient.connect(port)
            busy = await third.reply()
            assert (busy.code, busy.enhanced) == (421, "4.7.0"), busy
            assert await third.closed()
            await third.close()
            other = await submit(port, message_bytes("conn:1"), source_ip="127.0.0.2")
            assert other.code == 250, other
            await held.pop().close()
            assert await all_released(guard) is False  # one is still held
            again = await submit(port, message_bytes("conn:2"))
            assert again.code == 250, again
        finally:
            for c in held:
                await c.close()
        assert await all_released(guard)
    assert len(upstream.received) == 2


async def test_connections_over_the_total_limit_get_421(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port, limits__max_connections=3)) as guard:
        port = guard.ports[0]
        held = [await RawClient.connect(port, f"127.0.0.{i}") for i in (1, 2, 3)]
        try:
            for c in held:
                assert (await c.reply()).code == 220
            fourth = await RawClient.connect(port, "127.0.0.4")
            busy = await fourth.reply()
            assert (busy.code, busy.enhanced) == (421, "4.7.0"), busy
            await fourth.close()
            await held.pop().close()
            # A slot freed: the next client is served.
            deadline = time.monotonic() + 5
            while True:
                reply = await submit(port, message_bytes("total:1"), source_ip="127.0.0.5")
                if reply.code == 250 or time.monotonic() > deadline:
                    break
        finally:
            for c in held:
                await c.close()
        assert await all_released(guard)
    assert reply.code == 250, reply
    assert len(upstream.received) == 1


# --- timeouts -----------------------------------------------------------------------------------
async def test_idle_client_gets_421_and_is_disconnected_while_others_are_served(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(base_config(tmp, upstream.port, limits__idle_timeout="1s")) as guard:
        port = guard.ports[0]
        async with session(port) as idle:
            other = await submit(port, message_bytes("idle:1"))
            assert other.code == 250, other
            bye = await idle.reply(timeout=10)  # the bound: a client never timed out fails here
            assert (bye.code, bye.enhanced) == (421, "4.4.2") and "Idle" in bye.text, bye
            assert await idle.closed()
        assert await all_released(guard)
    assert len(upstream.received) == 1


async def test_slow_data_is_cut_by_data_timeout(tmp: Path, upstream: Upstream) -> None:
    """A client that keeps sending a line now and then is never idle; data_timeout still
    bounds its DATA phase."""
    cfg = base_config(tmp, upstream.port, limits__idle_timeout="1s", limits__data_timeout="2s")
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        async with session(port) as slow:
            await slow.command("MAIL FROM:<billing@acme.example>")
            await slow.command("RCPT TO:<customer@example.com>")
            assert (await slow.command("DATA")).code == 354
            slow.write(message_bytes("slow:1")[:-2])

            async def trickle() -> None:
                while True:
                    slow.write(b"still here\r\n")
                    await slow.writer.drain()
                    await asyncio.sleep(0.3)

            trickler = asyncio.create_task(trickle())
            try:
                other = await submit(port, message_bytes("slow:2"))
                bye = await slow.reply(timeout=10)
            finally:
                await stop(trickler)
            # Cut by data_timeout ("took too long"; idle_timeout would say "Idle"), and at all:
            # the trickle never ends, so a DATA phase left unbounded fails reply()'s bound.
            assert (bye.code, bye.enhanced) == (421, "4.4.2") and "took too long" in bye.text, bye
            assert await slow.closed()
        assert guard.store is not None and await guard.store.get("acme", "slow:1") is None
        assert await all_released(guard)
    assert other.code == 250, other
    assert [r.header("X-Event-Key") for r in upstream.received] == ["slow:2"]


async def test_slowloris_byte_by_byte_in_data_hits_the_idle_timeout(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, limits__idle_timeout="1s")
    async with running_guard(cfg) as guard, session(guard.ports[0]) as slow:
        await slow.command("MAIL FROM:<billing@acme.example>")
        await slow.command("RCPT TO:<customer@example.com>")
        assert (await slow.command("DATA")).code == 354

        async def one_byte_at_a_time() -> None:
            for byte in b"From: billing@acme.example\r\nTo: customer@example.com\r\n":
                slow.write(bytes([byte]))
                await slow.writer.drain()
                await asyncio.sleep(0.25)

        trickler = asyncio.create_task(one_byte_at_a_time())
        try:
            bye = await slow.reply()
            # cut while the header was still trickling in (it would take 14 s whole)
            cut_short = not trickler.done()
        finally:
            await stop(trickler)
        assert (bye.code, bye.enhanced) == (421, "4.4.2") and "Idle" in bye.text, bye
        assert cut_short
    assert upstream.handler.transactions == 0


async def test_timeouts_never_cut_a_relay_in_progress(tmp: Path, upstream: Upstream) -> None:
    """Once the final dot is in, the client waits on smtpguard: a provider slower than
    idle_timeout and data_timeout still gets its answer through."""
    upstream.handler.script = [Behaviour(hang_after_dot=2.5)]
    cfg = base_config(tmp, upstream.port, limits__idle_timeout="1s", limits__data_timeout="1s")
    async with running_guard(cfg) as guard:
        reply = await submit(guard.ports[0], message_bytes("slowrelay:1"))
    assert reply.code == 250 and "queued as" in reply.text, reply


async def test_client_hanging_up_after_the_dot_does_not_abandon_the_relay(
    tmp: Path, upstream: Upstream
) -> None:
    upstream.handler.script = [Behaviour(hang_after_dot=1.0)]
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        async with session(guard.ports[0]) as c:
            await c.command("MAIL FROM:<billing@acme.example>")
            await c.command("RCPT TO:<customer@example.com>")
            assert (await c.command("DATA")).code == 354
            c.write(terminated(message_bytes("hangup:1")))
            await c.writer.drain()
        store = guard.store
        assert store is not None
        record = await eventually(
            lambda: store.get("acme", "hangup:1"),
            lambda r: r is not None and r.state != "in_flight",
            timeout=10,
            interval=0.05,
        )
        assert record is not None and record.state == "delivered", record
        # A retry by the client is a duplicate, never a second send.
        retry = await submit(guard.ports[0], message_bytes("hangup:1"))
    assert retry.code == 250 and "duplicate" in retry.text, retry
    assert len(upstream.received) == 1
