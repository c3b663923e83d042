"""Socket fuzzer: random and mutated DATA and header bytes against an in-process smtpguard.

    python -m tests.support.fuzz_data --seconds 60 [--seed N]      (or scripts/fuzz …)

A real smtpguard (SQLite store) relays to a real recording upstream. Every input is one SMTP
transaction over a raw socket; after each one the fuzzer checks that

- smtpguard answered: a well-formed reply within the timeout (or 421 and a hang-up);
- a reply other than a fresh 250 left the upstream's count unchanged, a fresh 250 added
  exactly one message, and a duplicate 250 added none;
- what reached the upstream is the accepted message unchanged and CRLF-clean (no bare CR,
  LF or NUL: nothing smuggled);
- nothing logged a traceback;
and, at the end, that a well-behaved client is still served.

Exit status 1 when any of these failed; the summary (JSON) counts inputs, replies and crashes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smtpguard.server import Server
from tests.support import PASSWORD, Upstream, base_config, running_guard
from tests.support.hostile import CLOSED, RawClient, SmtpReply, terminated

REPLY_TIMEOUT = 30.0


@dataclass
class Stats:
    inputs: int = 0
    relayed: int = 0
    duplicates: int = 0
    crashes: int = 0
    replies: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    seed: int = 0

    def fail(self, what: str, payload: bytes) -> None:
        self.crashes += 1
        if len(self.violations) < 20:
            self.violations.append(f"{what}; input {payload[:300]!r}")

    def summary(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "seconds": round(self.seconds, 1),
            "inputs": self.inputs,
            "relayed": self.relayed,
            "duplicates": self.duplicates,
            "crashes": self.crashes,
            "replies": dict(sorted(self.replies.items())),
            "violations": self.violations,
        }


class _Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "never retrieved" in record.getMessage():
            self.records.append(record)


def fuzz_config(workdir: Path, upstream_port: int) -> dict[str, Any]:
    cfg = base_config(
        workdir,
        upstream_port,
        limits__max_message_size="256kB",
        limits__auth_failures=1_000_000,
        event_key__min_retry_interval="1s",
    )
    for zone in cfg["zones"].values():
        zone.update(hourly_cap=10**9, monthly_cap=10**9)
    return cfg


class Target:
    """A running smtpguard and its upstream, and one SMTP session to throw inputs at."""

    def __init__(self, guard: Server, upstream: Upstream, stats: Stats) -> None:
        self.guard = guard
        self.upstream = upstream
        self.stats = stats
        self._client: RawClient | None = None

    @property
    def port(self) -> int:
        return self.guard.ports[0]

    async def _session(self) -> RawClient:
        if self._client is None:
            client = await RawClient.connect(self.port)
            for step in (client.reply(), client.ehlo(), client.login("acme-app", PASSWORD)):
                reply = await step
                if reply.code not in (220, 250, 235):
                    await client.close()
                    raise RuntimeError(f"cannot open a session: {reply}")
            self._client = client
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def transact(
        self,
        payload: bytes,
        sender: str = "billing@acme.example",
        recipients: tuple[str, ...] = ("customer@example.com",),
    ) -> SmtpReply:
        """One MAIL/RCPT/DATA transaction with `payload` dot-stuffed; checks the invariants."""
        self.stats.inputs += 1
        before = len(self.upstream.received)
        try:
            reply = await self._transaction(payload, sender, recipients)
        except TimeoutError:
            self.stats.fail(f"no reply within {REPLY_TIMEOUT}s", payload)
            await self.close()
            return CLOSED
        self.stats.replies[str(reply.code)] += 1
        if reply.code in (0, 421):
            await self.close()
        if reply.code == 0:
            self.stats.fail("connection closed without a reply", payload)
        elif reply.code < 0:
            self.stats.fail(f"malformed reply {reply.text!r}", payload)
        added = self.upstream.received[before:]
        fresh = reply.code == 250 and "duplicate" not in reply.text
        if fresh:
            self.stats.relayed += 1
        elif reply.code == 250:
            self.stats.duplicates += 1
        if len(added) != (1 if fresh else 0):
            self.stats.fail(f"reply {reply} but the upstream received {len(added)} message(s)", payload)
        for message in added:
            content = message.content
            if (
                content.count(b"\r\n") != content.count(b"\n")
                or content.count(b"\r") != content.count(b"\r\n")
                or b"\x00" in content
            ):
                self.stats.fail("bare CR, LF or NUL reached the upstream", payload)
            expected = payload if payload.endswith(b"\r\n") else payload + b"\r\n"
            if not content.endswith(expected):
                self.stats.fail("the upstream received something else than the accepted message", payload)
        return reply

    async def _transaction(self, payload: bytes, sender: str, recipients: tuple[str, ...]) -> SmtpReply:
        c = await self._session()
        async with asyncio.timeout(REPLY_TIMEOUT):
            reset = await c.command("RSET")
            if reset.code != 250:
                return reset
            reply = await c.command(f"MAIL FROM:<{sender}>".encode("utf-8", "surrogateescape"))
            if reply.code != 250:
                return reply
            accepted = 0
            for rcpt in recipients:
                r = await c.command(f"RCPT TO:<{rcpt}>".encode("utf-8", "surrogateescape"))
                if r.code == 250:
                    accepted += 1
                elif r.code in (0, 421):
                    return r
                else:
                    reply = r
            if not accepted:
                return reply
            return await c.data(terminated(payload), timeout=REPLY_TIMEOUT)


@contextlib.asynccontextmanager
async def target(workdir: Path, stats: Stats) -> AsyncIterator[Target]:
    upstream = Upstream()
    await upstream.start()
    catcher = _Tracebacks()
    logging.getLogger().addHandler(catcher)
    try:
        async with running_guard(fuzz_config(workdir, upstream.port)) as guard:
            t = Target(guard, upstream, stats)
            try:
                yield t
            finally:
                await t.close()
    finally:
        logging.getLogger().removeHandler(catcher)
        await upstream.stop()
        for record in catcher.records:
            stats.crashes += 1
            stats.violations.append(f"logged a traceback: {record.name}: {record.getMessage()}")


# --- inputs -------------------------------------------------------------------------------------
SEEDS: list[bytes] = [
    b"From: billing@acme.example\r\nTo: customer@example.com\r\nSubject: Invoice {n}\r\n"
    b"X-Event-Key: fuzz:{n}\r\n\r\nYour invoice.\r\n",
    b"From: Acme Billing <billing@acme.example>\r\nTo: a@example.com, b@example.org\r\n"
    b"Subject: =?utf-8?q?Rechnung_{n}?=\r\nX-Event-Key: fuzz:{n}\r\nMIME-Version: 1.0\r\n"
    b'Content-Type: multipart/alternative; boundary="b{n}"\r\n\r\n--b{n}\r\n'
    b"Content-Type: text/plain; charset=utf-8\r\n\r\nHallo \xc3\xa9\r\n.leading dot\r\n--b{n}--\r\n",
    b"From: =?utf-8?b?YmlsbGluZ0BhY21lLmV4YW1wbGU=?= <billing@acme.example>\r\n"
    b"Subject: folded\r\n header\r\n\tagain\r\nX-Event-Key: fuzz:{n}\r\n\r\n\r\n.\r\n..\r\nend\r\n",
    b"From: alerts@notify.acme.example\r\nX-Event-Key: fuzz:{n}\r\nSubject: x\r\n\r\n" + b"a" * 990 + b"\r\n",
    b"From: billing@acme.example\r\nX-Event-Key: fuzz:{n}\r\n\r\nbody\n.\r\n"
    b"MAIL FROM:<billing@acme.example>\r\n"
    b"RCPT TO:<victim@example.org>\r\nDATA\r\nX-Event-Key: inner:{n}\r\n\r\nsmuggled\r\n",
    b"From: billing@acme.example\r\nX-Event-Key: fuzz:{n}\r\nSubject: big\r\n\r\n"
    + (b"y" * 78 + b"\r\n") * 3400,
]
SPECIALS = [
    b"\r",
    b"\n",
    b"\x00",
    b"\r\n",
    b"\r\n.",
    b"\n.\n",
    b"\r.\r",
    b".\r\n",
    b":",
    b" ",
    b"\t",
    b"\r\n ",
    b"\r\n\r\n",
    b"=?utf-8?b?",
    b"?=",
    b"<",
    b">",
    b"@",
    b",",
    b'"',
    b"(",
    b")",
    b"\xff",
    b"\xc3",
    b"\xe9",
    b"\x7f",
    b"From: ",
    b"From: evil@attacker.example\r\n",
    b"X-Event-Key: ",
    b"X-Event-Key: dup\r\n",
    b"x" * 1200,
    b"\r\n\t" + b"f" * 900,
]
ADDRESSES = [
    "billing@acme.example",
    "x@notify.acme.example",
    "info@globex.example",
    "billing%a@acme.example",
    "@acme.example:billing@acme.example",
    '"billing@acme.example"@x.example',
    "a@b@acme.example",
    "x.example!billing@acme.example",
    "billing@[127.0.0.1]",
    "",
    "billing@acme.example\udcff",
]


def seed_input(rng: random.Random, n: int) -> bytes:
    return rng.choice(SEEDS).replace(b"{n}", str(n).encode())


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(8)
        pos = rng.randint(0, len(buf))
        if op == 0 and buf:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[pos:pos] = rng.choice(SPECIALS)
        elif op == 2 and buf:
            del buf[pos : pos + rng.randint(1, 64)]
        elif op == 3 and buf:
            start = rng.randrange(len(buf))
            buf[pos:pos] = buf[start : start + rng.randint(1, 256)]
        elif op == 4:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 32))
        elif op == 5:
            lines = bytes(buf).split(b"\r\n")
            i = rng.randrange(len(lines))
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
            buf = bytearray(b"\r\n".join(lines))
        elif op == 6:
            del buf[pos:]
        else:
            buf[pos:pos] = b"\r\n" + rng.choice(SPECIALS) + b"\r\n"
    return bytes(buf)


def next_input(rng: random.Random, n: int) -> tuple[bytes, str, tuple[str, ...]]:
    roll = rng.random()
    if roll < 0.1:
        payload = rng.randbytes(rng.randint(0, 2048))
    elif roll < 0.3:
        payload = seed_input(rng, n)
    else:
        payload = mutate(rng, seed_input(rng, n))
    sender, recipients = "billing@acme.example", ("customer@example.com",)
    if rng.random() < 0.1:
        sender = rng.choice(ADDRESSES)
    if rng.random() < 0.1:
        recipients = tuple(rng.choice(ADDRESSES) or "x@example.com" for _ in range(rng.randint(1, 3)))
    return payload, sender, recipients


async def run(seconds: float, seed: int, workdir: Path) -> Stats:
    stats = Stats(seed=seed)
    rng = random.Random(seed)
    started = time.monotonic()
    async with target(workdir, stats) as t:
        sent: list[bytes] = []
        n = 0
        while time.monotonic() - started < seconds:
            n += 1
            if sent and rng.random() < 0.05:
                # The same accepted message again: a duplicate, never a second send.
                await t.transact(rng.choice(sent))
                continue
            payload, sender, recipients = next_input(rng, n)
            reply = await t.transact(payload, sender, recipients)
            if reply.code == 250 and sender == "billing@acme.example" and len(sent) < 100:
                sent.append(payload)
        await t.close()
        final = await t.transact(SEEDS[0].replace(b"{n}", b"final"))
        if final.code != 250:
            stats.fail(f"a clean message after the run was answered {final}", b"")
    stats.seconds = time.monotonic() - started
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=None, help="store and logs (default: a temp dir)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mail.log").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="smtpguard-fuzz-") as tmp:
        workdir = args.workdir or Path(tmp)
        stats = asyncio.run(run(args.seconds, seed, workdir))
    print(json.dumps(stats.summary(), indent=2))
    return 1 if stats.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
