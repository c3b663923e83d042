"""Real parts for the address tests: an upstream that offers SMTPUTF8, a client that declares it.

The recording upstream of tests/support/__init__.py is aiosmtpd's default, which does not offer
SMTPUTF8; Utf8Upstream is the same recorder with it on, and it notes the MAIL parameters
each transaction came with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosmtplib
import pytest
import redis
from aiosmtpd.smtp import SMTP, Envelope, Session

from smtpguard.policy.limits import month_of
from smtpguard.server import Server
from smtpguard.store import CapUsage
from tests.support import PASSWORD, RecordingHandler, RedisServer, Upstream


class _OptionsRecorder(RecordingHandler):
    def __init__(self) -> None:
        super().__init__()
        self.mail_options: list[list[str]] = []

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        self.mail_options.append(list(options))
        return await super().handle_MAIL(server, session, envelope, address, options)


class Utf8Upstream(Upstream):
    """The recording upstream, offering SMTPUTF8 in its EHLO."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder = _OptionsRecorder()
        self.handler = self.recorder

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: SMTP(self.handler, hostname="upstream", ident="utf8-upstream", enable_SMTPUTF8=True),
            "127.0.0.1",
            self.port,
            reuse_address=True,
        )


@contextlib.asynccontextmanager
async def utf8_upstream() -> AsyncIterator[Utf8Upstream]:
    up = Utf8Upstream()
    await up.start()
    try:
        yield up
    finally:
        await up.stop()


@dataclass
class Answer:
    code: int
    text: str

    @property
    def enhanced(self) -> str:
        return self.text.split(" ", 1)[0]

    def __str__(self) -> str:
        return f"{self.code} {self.text}"


@dataclass
class Transaction:
    """smtpguard's answer to each command of one mail transaction."""

    mail: Answer
    rcpts: list[Answer] = field(default_factory=list)
    data: Answer | None = None


async def transact(
    port: int,
    sender: str,
    recipients: Iterable[str],
    content: bytes,
    *,
    smtputf8: bool = False,
    user: str = "acme-app",
    password: str = PASSWORD,
) -> Transaction:
    """MAIL (with SMTPUTF8 when asked), each RCPT, then DATA if any recipient was taken;
    addresses go on the wire as UTF-8, as an SMTPUTF8 client writes them, or as a client
    that ignores the rule does."""
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False, timeout=20)
    await client.connect()
    try:
        await client.login(user, password)
        options = ["SMTPUTF8"] if smtputf8 else []
        mail = await _answer(client.mail(sender, options=options, encoding="utf-8"))
        result = Transaction(mail)
        if mail.code != 250:
            return result
        for rcpt in recipients:
            result.rcpts.append(await _answer(client.rcpt(rcpt, encoding="utf-8")))
        result.data = await _answer(client.data(content))
        return result
    finally:
        with contextlib.suppress(Exception):
            await client.quit()
        client.close()


async def _answer(command: Awaitable[aiosmtplib.SMTPResponse]) -> Answer:
    try:
        response = await command
    except aiosmtplib.SMTPResponseException as e:
        return Answer(e.code, e.message)
    return Answer(response.code, response.message)


async def cap_usage(guard: Server, zone: str = "acme") -> CapUsage:
    assert guard.store is not None
    now = guard.clock()
    return await guard.store.cap_usage(zone, now, month_of(now))


def raw_message(key: str, *, sender: str = "billing@acme.example", to: str = "customer@example.com") -> bytes:
    """A CRLF message; its header From and To may hold UTF-8 (RFC 6532) as written."""
    head = f"From: {sender}\r\nTo: {to}\r\nSubject: Invoice\r\nX-Event-Key: {key}\r\n"
    return (head + "\r\nYour invoice.\r\n").encode()


def store_overrides(request: pytest.FixtureRequest, tmp: Path, redis_db: int) -> Iterator[dict[str, Any]]:
    """base_config overrides for a real SQLite file, or a database of its own (`redis_db`)
    on the session's real redis-server, flushed before and after."""
    if request.param == "sqlite":
        yield {"store__url": f"sqlite:///{tmp / 'state.db'}"}
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    url = server.url.rsplit("/", 1)[0] + f"/{redis_db}"
    plain = redis.Redis.from_url(url)
    plain.flushdb()
    # The session's redis-server does not fsync every write; these tests do not restart it.
    yield {"store__url": url, "store__unsafe": True}
    plain.flushdb()
    plain.close()
