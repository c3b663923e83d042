"""The relay's own upstream wire (relay/wire.py) against peers that misbehave on purpose: a
raw server scripted byte by byte, Postfix's smtp-sink with its fault flags, and the
recording aiosmtpd upstream as the standby. Every test counts what the upstreams received
and reads what the relay (or the ledger) concluded."""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiosmtplib.protocol import PERIOD_REGEX, normalize_message_line_endings

from smtpguard.config import SmtpProviderConfig, loads
from smtpguard.policy.failover import Attempted
from smtpguard.policy.outcome import Kind
from smtpguard.relay import Envelope, SmtpProvider
from tests.support import SmtpSink, Upstream, base_config, free_port, message, running_guard, send
from tests.support.eventually import eventually
from tests.support.hostile import make_cert

CUSTOMER, OTHER = "customer@example.com", "other@example.com"
SENDER = "billing@acme.example"

CLOSE = b"<close>"
"""Close the connection instead of replying."""
HANG = b"<hang>"
"""Never reply; keep reading until the client gives up and closes."""
HALF = b"<half>"
"""To DATA: 354, then close once part of the message has arrived."""
GONE = b"<354-close>"
"""To DATA: 354, then close at once."""

_END = re.compile(rb"(?:\r\n|\n|\r)\.(?:\r\n|\n|\r)")
"""The end of the message as the most lenient upstream would take it (a bare LF or CR
around the dot too): where a smuggled second message would begin."""


class Scripted:
    """An SMTP server read and written byte by byte. `replies` queues, per verb (mail, rcpt,
    data, dot, rset), the replies to give before the defaults; CLOSE, HANG and HALF are
    faults. Records every command line, every chunk read and every message (as written
    on the wire, up to its final dot)."""

    def __init__(
        self,
        *,
        pipelining: bool = True,
        trickle: bool = False,
        strict: bool = False,
        after_ehlo: bytes = b"",
        after_dot: bytes = b"",
        tls: ssl.SSLContext | None = None,
        starttls: ssl.SSLContext | None = None,
        batch: bool = False,
        eightbitmime: bool = True,
        **replies: list[bytes],
    ) -> None:
        self.port = free_port()
        self.pipelining = pipelining
        self.trickle = trickle
        """Every reply written one byte at a time, each byte its own segment."""
        self.strict = strict
        """Commands sent ahead of their turn (more than one line in a read, outside DATA)
        are refused with a 554 and the connection closed (Postfix's
        smtpd_reject_unauth_pipelining)."""
        self.after_ehlo = after_ehlo
        """Written in the EHLO reply's write, after it: bytes nobody asked for."""
        self.after_dot = after_dot
        """Written 50 ms after the reply to the final dot, while the session is idle."""
        self.tls = tls
        self.starttls = starttls
        self.batch = batch
        """Replies to every line already read go out in one write (a pipelining server)."""
        self.eightbitmime = eightbitmime
        """Whether EHLO offers 8BITMIME (RFC 6152)."""
        self._out = bytearray()
        self.replies = {k: list(v) for k, v in replies.items()}
        self.commands: list[bytes] = []
        self.chunks: list[bytes] = []
        self.messages: list[bytes] = []
        self.connections = 0
        self.closed_by_client = 0
        self.reached: dict[str, asyncio.Event] = {}
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    def at(self, point: str) -> asyncio.Event:
        """Set when the session reaches `point` (mail, data, body, dot)."""
        return self.reached.setdefault(point, asyncio.Event())

    def _next(self, verb: str, default: bytes) -> bytes:
        queue = self.replies.get(verb)
        return queue.pop(0) if queue else default

    async def _write(self, writer: asyncio.StreamWriter, data: bytes, flush: bool = False) -> None:
        if self.batch and not flush:
            self._out += data
            return
        if self._out:
            data, self._out = bytes(self._out) + data, bytearray()
        if self.trickle:
            for i in range(len(data)):
                writer.write(data[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0)
        else:
            writer.write(data)
            await writer.drain()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        buf = b""

        async def fill() -> bool:
            nonlocal buf
            await self._write(writer, b"", flush=True)
            chunk = await reader.read(65536)
            if chunk:
                self.chunks.append(chunk)
            buf += chunk
            return bool(chunk)

        try:
            await self._write(writer, b"220 scripted ESMTP\r\n")
            while True:
                while b"\n" not in buf:
                    if not await fill():
                        self.closed_by_client += 1
                        return
                if self.strict and buf.count(b"\n") > 1:
                    await self._write(writer, b"554 5.5.0 Error: improper command pipelining\r\n")
                    return
                line, buf = buf.split(b"\n", 1)
                line = line.rstrip(b"\r")
                self.commands.append(line)
                verb = line[:4].upper()
                if verb in (b"EHLO", b"HELO"):
                    ehlo = (
                        b"250-scripted\r\n"
                        + (b"250-STARTTLS\r\n" if self.starttls is not None else b"")
                        + (b"250-PIPELINING\r\n" if self.pipelining else b"")
                        + (b"250-8BITMIME\r\n" if self.eightbitmime else b"")
                        + b"250 HELP\r\n"
                    )
                    await self._write(writer, ehlo + self.after_ehlo)
                    continue
                if verb == b"STAR" and self.starttls is not None:
                    await self._write(writer, b"220 ready\r\n", flush=True)
                    await writer.start_tls(self.starttls)
                    continue
                if verb == b"QUIT":
                    await self._write(writer, b"221 bye\r\n")
                    return
                if verb == b"DATA":
                    self.at("data").set()
                    reply = self._next("data", b"354 go ahead\r\n")
                    if reply == GONE:
                        await self._write(writer, b"354 go ahead\r\n", flush=True)
                        return
                    if reply == HALF:
                        await self._write(writer, b"354 go ahead\r\n")
                        while len(buf) < 10:
                            if not await fill():
                                return
                        self.at("body").set()
                        return
                    if not await self._reply(reader, writer, reply):
                        return
                    if not reply.startswith(b"354"):
                        continue
                    while (end := _END.search(b"\r\n" + buf)) is None:
                        if not await fill():
                            self.closed_by_client += 1
                            return
                    # Searched with a CRLF in front: an empty message ends at the very start.
                    start, stop = max(end.start() - 2, 0), end.end() - 2
                    self.messages.append(buf[:start])
                    buf = buf[stop:]
                    self.at("dot").set()
                    if not await self._reply(
                        reader, writer, self._next("dot", b"250 2.0.0 Ok: queued as S1\r\n")
                    ):
                        return
                    if self.after_dot:
                        await asyncio.sleep(0.05)
                        await self._write(writer, self.after_dot)
                        self.at("after_dot").set()
                    continue
                name = {b"MAIL": "mail", b"RCPT": "rcpt", b"RSET": "rset"}.get(verb, "other")
                self.at(name).set()
                if not await self._reply(reader, writer, self._next(name, b"250 2.0.0 ok\r\n")):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _reply(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: bytes) -> bool:
        """Writes the reply; False when the session ends here."""
        if reply == CLOSE:
            await self._write(writer, b"", flush=True)
            return False
        if reply == HANG:
            await self._write(writer, b"", flush=True)
            while await reader.read(65536):
                pass
            self.closed_by_client += 1
            return False
        await self._write(writer, reply)
        return True

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._session, "127.0.0.1", self.port, ssl=self.tls)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)


def _provider(tmp: Path, port: int, **extra: Any) -> SmtpProvider:
    cfg = base_config(tmp, port)
    cfg["providers"][0].update({"timeouts": {"connect": "2s", "command": "1s", "data": "1s"}, **extra})
    pcfg = loads(yaml.safe_dump(cfg)).providers[0]
    assert isinstance(pcfg, SmtpProviderConfig)
    return SmtpProvider(pcfg, None, "guard.test")


def _env(key: str, *recipients: str, body: bytes | None = None) -> Envelope:
    content = f"Subject: {key}\r\nX-Event-Key: {key}\r\n\r\n".encode() + (
        body if body is not None else b"hi\r\n"
    )
    return Envelope("acme", key, f"a-{key}", SENDER, recipients or (CUSTOMER,), content)


async def _marked() -> None:
    return None


async def _send_all(provider: SmtpProvider, *envs: Envelope) -> list[Attempted]:
    try:
        return [await provider.send(env, _marked) for env in envs]
    finally:
        await provider.close()


def _as_aiosmtplib_writes(content: bytes) -> bytes:
    """The message as aiosmtplib itself puts it on the wire, without the final dot."""
    return PERIOD_REGEX.sub(b"..", normalize_message_line_endings(content)).removesuffix(b"\r\n")


# --- smuggling: one message in, exactly one message out -----------------------------------------
SMUGGLE = b"MAIL FROM:<evil@attacker.example>\r\nRCPT TO:<victim@example.com>\r\nDATA\r\nsmuggled\r\n"


@pytest.mark.parametrize(
    "body",
    [
        b"bare\nLF\nlines\n",
        b"bare\rCR\rlines",
        b"x\n.\n" + SMUGGLE,
        b"x\r\n.\n" + SMUGGLE,
        b"x\n.\r\n" + SMUGGLE,
        b"x\r.\r" + SMUGGLE,
        b"x\r\n.\r\n" + SMUGGLE + b".\r\n",
        b"a final line without CRLF",
        b".",
        b"",
        b"\r\n.\r\n",
        b"..\r\n.",
    ],
    ids=[
        "lf",
        "cr",
        "lf-dot-lf",
        "crlf-dot-lf",
        "lf-dot-crlf",
        "cr-dot-cr",
        "crlf-dot-crlf",
        "no-eol",
        "dot",
        "empty",
        "only-terminator",
        "dots",
    ],
)
async def test_a_body_cannot_smuggle_a_second_message(tmp: Path, body: bytes) -> None:
    async with Scripted() as up:
        env = _env("smuggle", body=body)
        (result,) = await _send_all(_provider(tmp, up.port), env)
    assert result.outcome.kind is Kind.DELIVERED, result.outcome
    # Even a server that ends DATA at a bare-LF or bare-CR dot reads one message, the one
    # aiosmtplib would have written, and no command after it but the relay's own.
    assert up.messages == [_as_aiosmtplib_writes(env.content)]
    assert [c for c in up.commands if c.startswith((b"MAIL", b"RCPT", b"DATA"))] == [
        b"MAIL FROM:<billing@acme.example>",
        b"RCPT TO:<customer@example.com>",
        b"DATA",
    ]


# --- replies: split, joined, long, malformed, unsolicited ----------------------------------------
async def test_replies_written_one_byte_at_a_time_are_read_and_the_session_stays_in_step(tmp: Path) -> None:
    async with Scripted(trickle=True) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("t1"), _env("t2", CUSTOMER, OTHER))
    assert first.outcome.kind is Kind.DELIVERED and second.outcome.kind is Kind.DELIVERED
    assert second.outcome.accepted == (CUSTOMER, OTHER)
    assert len(up.messages) == 2 and up.connections == 1


async def test_multi_line_replies_are_one_reply_each(tmp: Path) -> None:
    async with Scripted(
        mail=[b"250-first\r\n250-second\r\n250 sender ok\r\n"],
        rcpt=[b"250-a\r\n250 b\r\n"],
        dot=[b"250-one\r\n250 2.0.0 Ok: queued as M7\r\n"],
    ) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("m1"), _env("m2"))
    assert first.outcome.kind is Kind.DELIVERED and first.outcome.upstream_id == "M7"
    # The next message on the same session gets its own replies, not leftovers.
    assert second.outcome.kind is Kind.DELIVERED and second.outcome.upstream_id == "S1"
    assert len(up.messages) == 2 and up.connections == 1


async def test_bytes_nobody_asked_for_are_not_taken_as_a_reply(tmp: Path) -> None:
    # After the EHLO reply, in its write; and 50 ms after the first message's 250, while
    # the session is idle in the pool: neither is the next command's reply.
    async with Scripted(after_ehlo=b"554 5.0.0 unsolicited\r\n", after_dot=b"554 5.0.0 late junk\r\n") as up:
        provider = _provider(tmp, up.port)
        try:
            first = await provider.send(_env("u1"), _marked)
            # The junk is written while the session is idle in the pool, before the next send.
            await asyncio.wait_for(up.at("after_dot").wait(), 5)
            second = await provider.send(_env("u2"), _marked)
        finally:
            await provider.close()
    assert first.outcome.kind is Kind.DELIVERED and second.outcome.kind is Kind.DELIVERED
    assert len(up.messages) == 2 and up.connections == 1


async def test_extra_replies_after_the_last_rcpt_are_dropped(tmp: Path) -> None:
    async with Scripted(rcpt=[b"250 ok\r\n250 extra\r\n550 extra\r\n"]) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("e1"), _env("e2"))
    assert first.outcome.kind is Kind.DELIVERED and second.outcome.kind is Kind.DELIVERED
    assert len(up.messages) == 2 and up.connections == 1


async def test_replies_to_hundreds_of_pipelined_recipients_in_one_write_are_read(tmp: Path) -> None:
    # 700 RCPT replies of sendmail's length, answered in one write: 37 KB that arrive in
    # one read, every reply in it short. The bound is on one reply, not on the read.
    recipients = [f"user{i:04}@example.com" for i in range(700)]
    rcpt = [f"250 2.1.5 <{r}>... Recipient ok\r\n".encode() for r in recipients]
    async with Scripted(batch=True, rcpt=rcpt) as up:
        (result,) = await _send_all(_provider(tmp, up.port), _env("many", *recipients))
    assert sum(len(r) for r in rcpt) > 32768
    assert max(len(c) for c in up.chunks) > 20000  # the group went out in one write
    assert result.outcome.kind is Kind.DELIVERED, result.outcome
    assert len(result.outcome.accepted) == 700 and len(up.messages) == 1


@pytest.mark.parametrize(
    "mail",
    [
        b"250-" + b"x" * 9000 + b"\r\n250 ok\r\n",
        b"250-" + b"x" * 200_000,
        b"250-more\r\n" * 20_000,
        b"250-ok\r\nnot a reply at all\r\n",
        b"hello\r\n",
        b"25 ok\r\n",
        b"2_50 ok\r\n",
        b"354 go on\r\n",
    ],
    ids=[
        "line-too-long",
        "endless-line",
        "endless-continuations",
        "non-numeric-continuation",
        "non-numeric",
        "two-digits",
        "underscore",
        "not-a-final-reply",
    ],
)
async def test_a_reply_that_is_not_smtp_before_data_is_unavailable_never_failed(
    tmp: Path, mail: bytes
) -> None:
    # DESIGN.md §11.6: any error before the final dot is unavailable or temporary; a reply
    # the relay cannot read says nothing about the message, so the next provider may take it.
    async with Scripted(mail=[mail]) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("n1"), _env("n2"))
    assert first.outcome.kind is Kind.UNAVAILABLE and first.failover, first.outcome
    assert not first.outcome.data_sent
    # That session was closed; the next message went on a fresh one.
    assert second.outcome.kind is Kind.DELIVERED and up.connections == 2
    assert len(up.messages) == 1


@pytest.mark.parametrize(
    "dot",
    [b"hello\r\n", b"250-" + b"x" * 200_000, b"354 go on\r\n250 2.0.0 queued as Z\r\n", b"25 ok\r\n"],
    ids=["non-numeric", "endless-line", "not-a-final-reply", "two-digits"],
)
async def test_a_reply_to_the_dot_that_is_not_smtp_is_unknown(tmp: Path, dot: bytes) -> None:
    # The message was written: whatever the provider did with it, this is not its answer.
    async with Scripted(dot=[dot]) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("d1"), _env("d2"))
    assert first.outcome.kind is Kind.UNKNOWN and not first.failover, first.outcome
    assert first.outcome.data_sent
    assert second.outcome.kind is Kind.DELIVERED and up.connections == 2
    assert len(up.messages) == 2


async def test_data_answered_250_instead_of_354_is_not_a_delivery(tmp: Path) -> None:
    # No byte of the message was written: a 250 to the DATA command cannot be its outcome.
    async with Scripted(data=[b"250 2.0.0 ok\r\n"]) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("x1"), _env("x2"))
    assert first.outcome.kind is Kind.UNAVAILABLE and first.failover, first.outcome
    assert not first.outcome.data_sent
    assert second.outcome.kind is Kind.DELIVERED and up.connections == 2
    assert len(up.messages) == 1


# --- through smtpguard: what the client hears and what the ledger keeps ---------------------------
@contextlib.asynccontextmanager
async def _guard(tmp: Path, primary: int) -> AsyncIterator[tuple[Any, Upstream]]:
    """smtpguard relaying to `primary`, with a recording standby behind it."""
    standby = Upstream()
    await standby.start()
    cfg = base_config(tmp, None)
    timeouts = {"connect": "2s", "command": "1s", "data": "1s"}
    cfg["providers"] = [
        {"name": name, "kind": "smtp", "host": "127.0.0.1", "port": port, "tls": "none", "timeouts": timeouts}
        for name, port in (("primary", primary), ("standby", standby.port))
    ]
    try:
        async with running_guard(cfg) as guard:
            yield guard, standby
    finally:
        await standby.stop()


async def _state(guard: Any, key: str) -> str:
    record = await guard.store.get("acme", key)
    assert record is not None
    return str(record.state.value)


async def test_data_answered_250_is_failed_over_not_recorded_delivered(tmp: Path) -> None:
    async with Scripted(data=[b"250 2.0.0 ok\r\n"]) as up, _guard(tmp, up.port) as (guard, standby):
        reply = await send(guard.ports[0], message("w1"))
        state = await _state(guard, "w1")
    # The primary never saw the message: a "delivered" here would be a message lost.
    assert up.messages == []
    assert reply.code == 250 and state == "delivered"
    assert [r.header("X-Event-Key") for r in standby.received] == ["w1"]


async def test_a_malformed_reply_to_mail_fails_over_and_is_not_failed(tmp: Path) -> None:
    async with Scripted(mail=[b"hello\r\n"]) as up, _guard(tmp, up.port) as (guard, standby):
        reply = await send(guard.ports[0], message("w2"))
        state = await _state(guard, "w2")
    assert up.messages == []
    assert reply.code == 250 and state == "delivered", (reply, state)
    assert [r.header("X-Event-Key") for r in standby.received] == ["w2"]


async def test_a_malformed_reply_to_the_dot_is_unknown_and_never_resent(tmp: Path) -> None:
    async with Scripted(dot=[b"hello\r\n"]) as up, _guard(tmp, up.port) as (guard, standby):
        reply = await send(guard.ports[0], message("w3"))
        again = await send(guard.ports[0], message("w3"))
        state = await _state(guard, "w3")
    assert len(up.messages) == 1 and standby.received == []
    assert (reply.code, again.code) == (451, 451) and state == "unknown", (reply, state)


@pytest.mark.parametrize(
    ("fault", "state", "copies"),
    [
        ({"rcpt": [b"421 4.7.0 closing\r\n", CLOSE]}, "delivered", (0, 1)),
        ({"rcpt": [CLOSE]}, "delivered", (0, 1)),
        ({"mail": [CLOSE]}, "delivered", (0, 1)),
        ({"data": [HALF]}, "unknown", (0, 0)),
        ({"dot": [CLOSE]}, "unknown", (1, 0)),
        ({"dot": [HANG]}, "unknown", (1, 0)),
    ],
    ids=[
        "421-mid-rcpt",
        "closed-after-mail",
        "closed-at-mail",
        "closed-mid-body",
        "closed-after-dot",
        "dot-never-answered",
    ],
)
async def test_a_connection_lost_fails_over_only_before_data(
    tmp: Path, fault: dict[str, list[bytes]], state: str, copies: tuple[int, int]
) -> None:
    async with Scripted(**fault) as up, _guard(tmp, up.port) as (guard, standby):
        reply = await send(guard.ports[0], message("c1"), recipients=[CUSTOMER, OTHER])
        again = await send(guard.ports[0], message("c1"), recipients=[CUSTOMER, OTHER])
        got = await _state(guard, "c1")
    assert got == state, (reply, got)
    assert (len(up.messages), len(standby.received)) == copies
    assert reply.code == (250 if state == "delivered" else 451)
    # The same event again is answered from the ledger, never sent a second time.
    assert again.code == reply.code


async def test_closed_right_after_the_354_is_never_sent_twice(tmp: Path) -> None:
    async with Scripted(data=[GONE]) as up, _guard(tmp, up.port) as (guard, standby):
        await send(guard.ports[0], message("c2"))
        await send(guard.ports[0], message("c2"))
        got = await _state(guard, "c2")
    # Whether the message was on the socket before the close was seen decides unknown
    # (held) or delivered through the standby; never both, never twice.
    assert up.messages == []
    assert (got, len(standby.received)) in (("unknown", 0), ("delivered", 1))


# --- Postfix's smtp-sink: its faults on a pipelined group ---------------------------------------
@pytest.mark.parametrize(
    ("flags", "state", "copies"),
    [
        (("-q", "RCPT"), "delivered", (0, 1)),  # hangs up after the group's RCPT: standby
        (("-Q", "MAIL"), "delivered", (0, 1)),  # 421 to the group's MAIL: standby
        (("-p", "-Q", "RCPT"), "delivered", (0, 1)),  # no PIPELINING, lock-step: the same
        (("-q", "DATA"), "delivered", (0, 1)),  # hangs up at DATA, before any byte of the message
        (("-Q", "DATA"), "delivered", (0, 1)),
        (("-W", ".:3"), "unknown", (1, 0)),  # the dot answered after the data timeout: held
        (("-Q", "."), "deferred", (1, 0)),  # 421 to the dot: the provider's answer, never failed over
    ],
)
async def test_smtp_sink_faults_on_the_pipelined_wire(
    tmp: Path, flags: tuple[str, ...], state: str, copies: tuple[int, int]
) -> None:
    sink = SmtpSink(tmp, *flags)
    sink.start()
    try:
        async with _guard(tmp, sink.port) as (guard, standby):
            await send(guard.ports[0], message("k1"), recipients=[CUSTOMER, OTHER])
            await send(guard.ports[0], message("k1"), recipients=[CUSTOMER, OTHER])
            got = await _state(guard, "k1")
        held = sink.event_keys()
    finally:
        sink.stop()
        sink.cleanup()
    assert got == state
    assert (held.count("k1"), len(standby.received)) == copies


# --- the pool after each fault ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fault", "connections"),
    [
        ({"rcpt": [b"550 5.1.1 no such user\r\n"]}, 1),  # refused, RSET 250: kept, in step
        ({"mail": [b"451 4.3.0 later\r\n"]}, 1),
        ({"dot": [b"554 5.7.1 no\r\n"]}, 1),
        ({"data": [b"451 4.3.0 not now\r\n"]}, 1),
        ({"rcpt": [b"550 5.1.1 no such user\r\n"], "rset": [b"500 5.5.1 what\r\n"]}, 2),  # RSET refused
        ({"rcpt": [b"550 5.1.1 no such user\r\n"], "rset": [HANG]}, 2),
        ({"mail": [b"421 4.4.2 bye\r\n"]}, 2),
        ({"dot": [HANG]}, 2),
    ],
    ids=[
        "rcpt-refused",
        "mail-deferred",
        "dot-refused",
        "data-deferred",
        "rset-refused",
        "rset-unanswered",
        "mail-421",
        "dot-unanswered",
    ],
)
async def test_after_a_fault_a_session_is_reused_only_in_step(
    tmp: Path, fault: dict[str, list[bytes]], connections: int
) -> None:
    async with Scripted(**fault) as up:
        provider = _provider(tmp, up.port)
        first, second, third = await _send_all(
            provider, _env("p1"), _env("p2", CUSTOMER, OTHER), _env("p3", OTHER)
        )
    assert first.outcome.kind is not Kind.DELIVERED
    # The messages after it got their own replies: every one delivered, each with its
    # own recipients, on the session kept (1) or on a fresh one (2).
    assert second.outcome.kind is Kind.DELIVERED and second.outcome.accepted == (CUSTOMER, OTHER)
    assert third.outcome.kind is Kind.DELIVERED and third.outcome.accepted == (OTHER,)
    assert up.connections == connections
    assert len(up.messages) == (3 if "dot" in fault else 2)


# --- pipelining: legal and hostile servers ----------------------------------------------------------
async def test_a_server_without_pipelining_gets_one_command_at_a_time(tmp: Path) -> None:
    # It closes the session when commands arrive ahead of their turn: none ever does.
    async with Scripted(pipelining=False, strict=True) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("l1", CUSTOMER, OTHER), _env("l2"))
    assert first.outcome.kind is Kind.DELIVERED and second.outcome.kind is Kind.DELIVERED
    assert len(up.messages) == 2 and up.connections == 1
    assert all(c.count(b"\n") == 1 for c in up.chunks if not c.startswith(b"Subject"))


async def test_a_server_offering_pipelining_that_refuses_it_fails_over_with_nothing_sent(tmp: Path) -> None:
    async with Scripted(pipelining=True, strict=True) as up, _guard(tmp, up.port) as (guard, standby):
        reply = await send(guard.ports[0], message("l3"), recipients=[CUSTOMER, OTHER])
        got = await _state(guard, "l3")
    # Its 554 and hang-up come before anything could be accepted: the standby takes it, once.
    assert up.messages == [] and up.commands == [b"EHLO guard.test"]
    assert (reply.code, got) == (250, "delivered")
    assert [r.header("X-Event-Key") for r in standby.received] == ["l3"]


# --- cancellation (a drain that timed out) at each await ------------------------------------------
@pytest.mark.parametrize("point", ["mail", "rcpt", "data", "dot"])
async def test_cancelled_at_each_wait_the_session_is_closed_never_reused(tmp: Path, point: str) -> None:
    async with Scripted(**{point: [HANG]}) as up:
        provider = _provider(tmp, up.port, timeouts={"connect": "2s", "command": "10s", "data": "10s"})
        try:
            task = asyncio.create_task(provider.send(_env("z1"), _marked))
            await asyncio.wait_for(up.at(point).wait(), 5)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            after = await provider.send(_env("z2"), _marked)
        finally:
            await provider.close()
        closed = await eventually(lambda: up.closed_by_client, lambda n: n >= 1, timeout=5, interval=0.02)
    assert after.outcome.kind is Kind.DELIVERED
    # The cancelled session was closed (the server read its EOF), the next had its own.
    assert up.connections == 2 and closed >= 1
    assert len(up.messages) == (2 if point == "dot" else 1)


# --- TLS: the take-over on STARTTLS and implicit TLS, faults included --------------------------
@pytest.mark.parametrize("tls", ["starttls", "implicit"])
async def test_trickled_replies_and_a_lost_dot_over_tls(tmp: Path, tls: str) -> None:
    cert, key = make_cert(tmp)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    server_tls = {"starttls": ctx} if tls == "starttls" else {"tls": ctx}
    async with Scripted(trickle=True, dot=[b"250 2.0.0 Ok: queued as T1\r\n", CLOSE], **server_tls) as up:
        provider = _provider(tmp, up.port, tls=tls, ca_file=str(cert))
        first, second, third = await _send_all(provider, _env("s1", CUSTOMER, OTHER), _env("s2"), _env("s3"))
    assert first.outcome.kind is Kind.DELIVERED and first.outcome.upstream_id == "T1"
    assert second.outcome.kind is Kind.UNKNOWN and not second.failover
    assert third.outcome.kind is Kind.DELIVERED
    assert len(up.messages) == 3 and up.connections == 2
