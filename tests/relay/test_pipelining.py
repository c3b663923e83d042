"""The upstream transaction past aiosmtplib's connect, TLS, EHLO and AUTH (relay/wire.py):
MAIL and RCPT pipelined to a provider that offers PIPELINING (RFC 2920), DATA lock-step,
every reply read in order, on real connections (aiosmtpd, over TLS too, and a raw server
that shows what arrives in which write)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiosmtpd.smtp import SMTP
from aiosmtpd.smtp import Envelope as SmtpEnvelope
from aiosmtpd.smtp import Session as SmtpSession
from aiosmtplib.protocol import PERIOD_REGEX, normalize_message_line_endings
from hypothesis import given
from hypothesis import strategies as st

from smtpguard.config import SmtpProviderConfig, loads
from smtpguard.policy.failover import Attempted
from smtpguard.policy.outcome import Kind
from smtpguard.relay import Envelope, SmtpProvider
from smtpguard.relay.wire import data_block
from tests.support import Behaviour, RecordingHandler, base_config, free_port
from tests.support.hostile import make_cert

CUSTOMER, OTHER = "customer@example.com", "other@example.com"


class PipeliningHandler(RecordingHandler):
    """The recording upstream, offering PIPELINING in its EHLO (aiosmtpd reads pipelined
    commands one line at a time, as any server must, but does not announce it)."""

    connections = 0

    async def handle_EHLO(
        self, server: SMTP, session: SmtpSession, envelope: SmtpEnvelope, hostname: str, responses: list[str]
    ) -> list[str]:
        session.host_name = hostname
        return [responses[0], "250-PIPELINING", *responses[1:]]


@contextlib.asynccontextmanager
async def aiosmtpd_upstream(
    handler: RecordingHandler,
    *,
    starttls: ssl.SSLContext | None = None,
    implicit: ssl.SSLContext | None = None,
) -> AsyncIterator[int]:
    port = free_port()
    loop = asyncio.get_running_loop()
    sessions: list[SMTP] = []

    def make() -> SMTP:
        s = SMTP(handler, hostname="upstream", tls_context=starttls, require_starttls=starttls is not None)
        sessions.append(s)
        if isinstance(handler, PipeliningHandler):
            handler.connections += 1
        return s

    server = await loop.create_server(make, "127.0.0.1", port, ssl=implicit)
    try:
        yield port
    finally:
        server.close()
        for s in sessions:
            if s.transport is not None:
                s.transport.close()
        await server.wait_closed()


def _provider(tmp: Path, port: int, **extra: Any) -> SmtpProvider:
    cfg = base_config(tmp, port)
    cfg["providers"][0].update(extra)
    pcfg = loads(yaml.safe_dump(cfg)).providers[0]
    assert isinstance(pcfg, SmtpProviderConfig)
    return SmtpProvider(pcfg, None, "guard.test")


def _env(key: str, *recipients: str) -> Envelope:
    body = f"Subject: {key}\r\nX-Event-Key: {key}\r\n\r\n.a line opening with a dot\r\nbye\r\n"
    return Envelope("acme", key, f"a-{key}", "billing@acme.example", recipients or (CUSTOMER,), body.encode())


async def _marked() -> None:
    return None


# --- a raw upstream: what arrives in which write ----------------------------------------------
class RawUpstream:
    """An SMTP server that answers MAIL and its RCPTs only once all of them have arrived,
    and then in one write: a client that waits for the MAIL reply before RCPT never gets
    one. Records every chunk read after EHLO."""

    def __init__(self, recipients: int) -> None:
        self.port = free_port()
        self.expect = 1 + recipients
        self.chunks: list[bytes] = []
        self.messages: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 raw ESMTP\r\n")
        buf = b""
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                if not buf.startswith(b"EHLO") and not chunk.startswith(b"EHLO"):
                    self.chunks.append(chunk)
                buf += chunk
                while b"\r\n" in buf:
                    if buf.startswith(b"EHLO"):
                        buf = buf.split(b"\r\n", 1)[1]
                        writer.write(b"250-raw\r\n250-PIPELINING\r\n250 8BITMIME\r\n")
                    elif buf.startswith(b"MAIL"):
                        lines = buf.split(b"\r\n")
                        if len(lines) <= self.expect:
                            break  # not all of the group yet: no reply at all
                        buf = b"\r\n".join(lines[self.expect :])
                        writer.write(b"250 2.1.0 ok\r\n" * self.expect)
                    elif buf.startswith(b"DATA\r\n"):
                        buf = buf[6:]
                        writer.write(b"354 go ahead\r\n")
                        while b"\r\n.\r\n" not in buf:
                            more = await reader.read(65536)
                            if not more:
                                return
                            buf += more
                        message, buf = buf.split(b"\r\n.\r\n", 1)
                        self.messages.append(message)
                        writer.write(b"250 2.0.0 Ok: queued as R1\r\n")
                    elif buf.startswith(b"QUIT"):
                        writer.write(b"221 bye\r\n")
                        writer.close()
                        return
                    else:
                        buf = buf.split(b"\r\n", 1)[1]
                        writer.write(b"250 ok\r\n")
                await writer.drain()

    async def __aenter__(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._session, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)


async def test_mail_and_rcpts_go_out_in_one_write_and_both_replies_in_one_segment_are_read(
    tmp: Path,
) -> None:
    async with RawUpstream(recipients=2) as raw:
        provider = _provider(tmp, raw.port)
        try:
            result = await provider.send(_env("p1", CUSTOMER, OTHER), _marked)
        finally:
            await provider.close()
    assert result.outcome.kind is Kind.DELIVERED, result.outcome
    assert result.outcome.accepted == (CUSTOMER, OTHER) and result.outcome.upstream_id == "R1"
    assert raw.chunks[0] == (
        b"MAIL FROM:<billing@acme.example>\r\nRCPT TO:<customer@example.com>\r\n"
        b"RCPT TO:<other@example.com>\r\n"
    )
    # DATA alone, then the message once the 354 was read; its leading dot doubled.
    assert raw.chunks[1] == b"DATA\r\n"
    [message] = raw.messages
    assert b"\r\n..a line opening with a dot\r\n" in message


# --- aiosmtpd offering PIPELINING: replies stay paired with their commands ----------------------
async def _through(
    tmp: Path, script: list[Behaviour], envelopes: list[Envelope], **provider_extra: Any
) -> tuple[PipeliningHandler, list[Attempted]]:
    """Each envelope sent in turn through one provider (one pool) to a pipelining upstream."""
    handler = PipeliningHandler()
    handler.script = script
    async with aiosmtpd_upstream(handler) as port:
        provider = _provider(tmp, port, **provider_extra)
        try:
            results = [await provider.send(env, _marked) for env in envelopes]
        finally:
            await provider.close()
    return handler, results


async def test_a_refused_mail_with_its_rcpts_in_flight_leaves_the_connection_in_step(tmp: Path) -> None:
    # The second goes out on the same pooled connection: the first one's RCPT 503 and RSET
    # 250 were read, so its replies are its own.
    handler, (refused, again) = await _through(
        tmp, [Behaviour(mail="451 4.3.0 try later")], [_env("r1"), _env("r2", CUSTOMER, OTHER)]
    )
    assert refused.outcome.kind is Kind.DEFERRED and refused.failover and not refused.outcome.data_sent
    assert refused.outcome.reply is not None and refused.outcome.reply.code == 451
    assert again.outcome.kind is Kind.DELIVERED and again.outcome.accepted == (CUSTOMER, OTHER)
    assert [r.header("X-Event-Key") for r in handler.received] == ["r2"]
    assert handler.transactions == 2 and handler.data_commands == 1 and handler.connections == 1


async def test_pipelined_recipients_refused_one_permanently_one_for_now(tmp: Path) -> None:
    script = [
        Behaviour(rcpt={OTHER: "550 5.1.1 no such user"}),
        Behaviour(rcpt={OTHER: "450 4.2.1 mailbox busy"}),
    ]
    envelopes = [_env("q1", CUSTOMER, OTHER), _env("q2", CUSTOMER, OTHER), _env("q3")]
    handler, (partial, deferred, after) = await _through(tmp, script, envelopes)
    assert partial.outcome.kind is Kind.DELIVERED and partial.outcome.accepted == (CUSTOMER,)
    assert [(r, reply.code) for r, reply in partial.outcome.rejected] == [(OTHER, 550)]
    # A temporary refusal defers the whole event: nothing of it reached the upstream.
    assert deferred.outcome.kind is not Kind.DELIVERED and not deferred.outcome.data_sent
    assert after.outcome.kind is Kind.DELIVERED
    assert [r.header("X-Event-Key") for r in handler.received] == ["q1", "q3"]
    assert handler.data_commands == 2 and handler.connections == 1


async def test_a_pipelined_mail_answered_late_times_out_before_data(tmp: Path) -> None:
    timeouts = {"connect": "2s", "command": "1s", "data": "3s"}
    handler, (late, after) = await _through(
        tmp, [Behaviour(hang_at_mail=3.0)], [_env("t1"), _env("t2")], timeouts=timeouts
    )
    assert late.outcome.kind is Kind.UNAVAILABLE and late.failover and not late.outcome.data_sent
    assert "SMTPReadTimeoutError" in late.outcome.detail
    # The session given up on was closed, not reused out of step.
    assert after.outcome.kind is Kind.DELIVERED and handler.connections == 2
    assert [r.header("X-Event-Key") for r in handler.received] == ["t2"]


async def test_an_answer_after_the_dot_that_comes_too_late_is_unknown(tmp: Path) -> None:
    timeouts = {"connect": "2s", "command": "2s", "data": "1s"}
    handler, (result,) = await _through(tmp, [Behaviour(hang_after_dot=3.0)], [_env("u1")], timeouts=timeouts)
    assert result.outcome.kind is Kind.UNKNOWN and result.outcome.data_sent and not result.failover
    assert len(handler.received) == 1


@pytest.mark.parametrize("tls", ["starttls", "implicit"])
async def test_the_transaction_runs_on_the_tls_session_aiosmtplib_set_up(tmp: Path, tls: str) -> None:
    cert, key = make_cert(tmp)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    handler = PipeliningHandler()
    tls_args = {"starttls": ctx} if tls == "starttls" else {"implicit": ctx}
    async with aiosmtpd_upstream(handler, **tls_args) as port:
        provider = _provider(tmp, port, tls=tls, ca_file=str(cert))
        try:
            first = await provider.send(_env("s1"), _marked)
            second = await provider.send(_env("s2", CUSTOMER, OTHER), _marked)
        finally:
            await provider.close()
    assert first.outcome.kind is Kind.DELIVERED and second.outcome.kind is Kind.DELIVERED
    assert [r.header("X-Event-Key") for r in handler.received] == ["s1", "s2"]
    assert handler.received[1].rcpt_tos == [CUSTOMER, OTHER] and handler.connections == 1


# --- the message as written after the 354 -------------------------------------------------------
@given(st.lists(st.sampled_from([b"a", b".", b"\r", b"\n", b"\r\n", b"..", b"x.y"]), max_size=30))
def test_data_block_is_what_aiosmtplib_would_send(parts: list[bytes]) -> None:
    message = b"".join(parts)
    assert data_block(message) == PERIOD_REGEX.sub(b"..", normalize_message_line_endings(message)) + b".\r\n"
