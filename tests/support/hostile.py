"""Helpers for the hostile-input tests: a raw-socket SMTP client, a throwaway certificate.

smtplib and aiosmtplib normalise line endings and dot-stuff for us, which is exactly what an
attacker does not do; these tests write bytes on an asyncio stream and read replies back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import ipaddress
import logging
import ssl
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smtpguard.policy.limits import month_of
from smtpguard.server import Server
from tests.support import PASSWORD
from tests.support.eventually import eventually


@dataclass(frozen=True)
class SmtpReply:
    code: int
    text: str
    """The text of every line, joined by newlines; code 0 means the server closed instead."""

    def __str__(self) -> str:
        return f"{self.code} {self.text}"

    @property
    def enhanced(self) -> str:
        return self.text.split(" ", 1)[0]


CLOSED = SmtpReply(0, "connection closed")


MAILBOX = {"listen": "127.0.0.1:0", "address": "reports@guard.test", "provider": "primary"}
"""An events mailbox (`events.mailbox`) on a free loopback port, for the acme zone's provider."""


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int, source_ip: str | None = None, timeout: float = 10) -> RawClient:
        local = (source_ip, 0) if source_ip else None
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, local_addr=local, limit=2**20), timeout
        )
        return cls(reader, writer)

    async def reply(self, timeout: float = 10) -> SmtpReply:
        lines: list[bytes] = []
        while True:
            try:
                line = await asyncio.wait_for(self.reader.readline(), timeout)
            except (ConnectionError, ssl.SSLError):
                line = b""
            if not line:
                return CLOSED if not lines else _parse(lines)
            lines.append(line)
            if len(line) < 4 or line[3:4] != b"-":
                return _parse(lines)

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def command(self, line: str | bytes, timeout: float = 10) -> SmtpReply:
        data = line.encode() if isinstance(line, str) else line
        self.writer.write(data if data.endswith(b"\n") else data + b"\r\n")
        await self.writer.drain()
        return await self.reply(timeout)

    async def ehlo(self, name: str = "client.test") -> SmtpReply:
        return await self.command(f"EHLO {name}")

    async def login(self, user: str = "acme-app", password: str = PASSWORD) -> SmtpReply:
        blob = base64.b64encode(f"\0{user}\0{password}".encode()).decode()
        return await self.command(f"AUTH PLAIN {blob}")

    async def data(self, payload: bytes, timeout: float = 20) -> SmtpReply:
        """DATA, then `payload` sent exactly as given (it must carry its own terminator)."""
        go = await self.command("DATA")
        if go.code != 354:
            return go
        self.writer.write(payload)
        await self.writer.drain()
        return await self.reply(timeout)

    async def starttls(self, ctx: ssl.SSLContext) -> None:
        await self.writer.start_tls(ctx, server_hostname="localhost")

    async def closed(self, timeout: float = 10) -> bool:
        """True when the server closes the connection (after any replies still queued)."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), timeout):
                pass
        except (ConnectionError, ssl.SSLError):
            pass
        return True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 5)


def _parse(lines: list[bytes]) -> SmtpReply:
    first = lines[-1]
    code = int(first[:3]) if first[:3].isdigit() else -1
    text = "\n".join(line[4:].decode("utf-8", "replace").rstrip("\r\n") for line in lines)
    return SmtpReply(code, text)


@contextlib.asynccontextmanager
async def session(
    port: int,
    *,
    login: bool = True,
    user: str = "acme-app",
    password: str = PASSWORD,
    source_ip: str | None = None,
) -> AsyncIterator[RawClient]:
    """A connected client past the greeting and EHLO (and AUTH PLAIN, unless login=False)."""
    client = await RawClient.connect(port, source_ip)
    try:
        greeting = await client.reply()
        assert greeting.code == 220, greeting
        ehlo = await client.ehlo()
        assert ehlo.code == 250, ehlo
        if login:
            auth = await client.login(user, password)
            assert auth.code == 235, auth
        yield client
    finally:
        await client.close()


def message_bytes(
    key: str | None = "hostile:1",
    *,
    sender: str = "billing@acme.example",
    to: str = "customer@example.com",
    subject: str = "Invoice",
    body: bytes = b"Your invoice.\r\n",
    extra: Iterable[bytes] = (),
    from_header: bytes | None = None,
) -> bytes:
    """A clean CRLF message (no terminator); `extra` header lines are added verbatim."""
    head = [from_header if from_header is not None else f"From: {sender}".encode()]
    head += [f"To: {to}".encode(), f"Subject: {subject}".encode()]
    if key is not None:
        head.append(f"X-Event-Key: {key}".encode())
    head += list(extra)
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def terminated(message: bytes) -> bytes:
    """Dot-stuffed and ended with <CRLF>.<CRLF>, as a well-behaved client sends it."""
    stuffed = message.replace(b"\r\n.", b"\r\n..")
    if stuffed.startswith(b"."):
        stuffed = b"." + stuffed
    if not stuffed.endswith(b"\r\n"):
        stuffed += b"\r\n"
    return stuffed + b".\r\n"


async def submit(
    port: int,
    message: bytes,
    *,
    sender: str = "billing@acme.example",
    recipients: Iterable[str] = ("customer@example.com",),
    source_ip: str | None = None,
) -> SmtpReply:
    """One well-behaved submission over a raw socket; the reply to whichever step refused."""
    async with session(port, source_ip=source_ip) as c:
        r = await c.command(f"MAIL FROM:<{sender}>")
        if r.code != 250:
            return r
        for rcpt in recipients:
            r = await c.command(f"RCPT TO:<{rcpt}>")
            if r.code != 250:
                return r
        r = await c.data(terminated(message))
        await c.command("QUIT")
        return r


async def nothing_recorded(guard: Server, zone: str, key: str) -> bool:
    """No ledger record for the key and no cap unit used by the zone."""
    assert guard.store is not None
    record = await guard.store.get(zone, key)
    now = guard.clock()
    usage = await guard.store.cap_usage(zone, now, month_of(now))
    return record is None and usage.hour == 0 and usage.month == 0


async def all_released(guard: Server, timeout: float = 5) -> bool:
    """Every connection slot is given back once the clients are gone."""
    assert guard.handler is not None
    # connection_lost runs some loop iterations after the client's close; nothing signals it.
    handler = guard.handler
    await eventually(
        lambda: handler.connections.total, lambda total: not total, timeout=timeout, interval=0.02
    )
    return guard.handler.connections.total == 0 and not guard.handler.connections.per_ip


def assert_no_tracebacks(records: Iterable[logging.LogRecord]) -> None:
    bad = [r for r in records if r.exc_info or "never retrieved" in r.getMessage()]
    assert not bad, [f"{r.name}: {r.getMessage()}" for r in bad]


# --- TLS ------------------------------------------------------------------------------------
def make_cert(directory: Path) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for localhost / 127.0.0.1."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def client_tls(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def with_starttls(cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    cert, key = make_cert(tmp)
    cfg["tls"] = {"cert": str(cert), "key": str(key)}
    cfg["listen"] = [{"address": "127.0.0.1:0", "tls": "starttls"}]
    return cfg
