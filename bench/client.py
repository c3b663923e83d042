"""The load client: N concurrent SMTP sessions over raw asyncio streams.

Each session connects once, EHLOs, AUTHs (PLAIN) once when the server offers AUTH and
credentials are given, then sends messages over the same connection: MAIL, RCPT, DATA, the
content, one reply each (no PIPELINING unless asked for and offered). Every message carries a
unique X-Event-Key unless the duplicate-storm picks an already-delivered key. The content of
a message depends on its key only, so a repeated key is the same message (same fingerprint).

Bounded: every run has a hard deadline; sessions still running after it are cancelled.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.common import PASSWORD, RECIPIENT, SENDER, USER

_FILLER_LINE = b"x" * 76 + b"\r\n"


def body_for(size: int) -> bytes:
    lines = max(1, size // len(_FILLER_LINE))
    return _FILLER_LINE * lines


def message_bytes(key: str, body: bytes) -> bytes:
    """The DATA payload for one event, dot-terminated (no line starts with '.')."""
    head = (
        f"From: Billing <{SENDER}>\r\n"
        f"To: {RECIPIENT}\r\n"
        f"Subject: Event {key}\r\n"
        f"X-Event-Key: {key}\r\n"
        "MIME-Version: 1.0\r\n"
        "Content-Type: text/plain; charset=us-ascii\r\n"
        "\r\n"
    ).encode()
    return head + body + b".\r\n"


class SmtpError(RuntimeError):
    pass


class Session:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r = reader
        self.w = writer
        self.caps: set[str] = set()
        self.authenticated = False

    @classmethod
    async def open(cls, port: int, auth: bool, host: str = "127.0.0.1") -> Session:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        s = cls(reader, writer)
        code, text = await s.reply()
        if code != 220:
            writer.close()
            raise SmtpError(f"greeting {code} {text}")
        code, text = await s.command(b"EHLO bench.client\r\n", full=True)
        if code != 250:
            writer.close()
            raise SmtpError(f"EHLO {code} {text}")
        s.caps = {line.split(" ", 1)[0].upper() for line in text.split("\n")[1:]}
        offers = [line.upper() for line in text.split("\n")]
        if auth and any(line.startswith("AUTH") and "PLAIN" in line for line in offers):
            blob = base64.b64encode(f"\0{USER}\0{PASSWORD}".encode()).decode()
            code, text = await s.command(f"AUTH PLAIN {blob}\r\n".encode())
            if code // 100 != 2:  # 235; smtp-sink answers 250 to anything
                writer.close()
                raise SmtpError(f"AUTH {code} {text}")
            s.authenticated = True
        return s

    async def reply(self, full: bool = False) -> tuple[int, str]:
        lines: list[str] = []
        while True:
            line = await self.r.readuntil(b"\r\n")
            if full:
                lines.append(line[4:-2].decode("utf-8", "replace"))
            if line[3:4] != b"-":
                text = "\n".join(lines) if full else line[4:-2].decode("utf-8", "replace")
                return int(line[:3]), text

    async def command(self, line: bytes, full: bool = False) -> tuple[int, str]:
        self.w.write(line)
        return await self.reply(full)

    async def send(self, data: bytes, pipelining: bool) -> tuple[int, str]:
        """One transaction; returns the first non-success reply or the final reply."""
        if pipelining:
            self.w.write(_MAIL + _RCPT + b"DATA\r\n")
            c1, t1 = await self.reply()
            c2, t2 = await self.reply()
            c3, t3 = await self.reply()
            if c1 != 250 or c2 != 250 or c3 != 354:
                if c3 == 354:
                    self.w.write(b".\r\n")
                    await self.reply()
                bad = next((c, t) for c, t in ((c1, t1), (c2, t2), (c3, t3)) if c not in (250, 354))
                return bad
        else:
            code, text = await self.command(_MAIL)
            if code != 250:
                return code, text
            code, text = await self.command(_RCPT)
            if code != 250:
                await self.command(b"RSET\r\n")
                return code, text
            code, text = await self.command(b"DATA\r\n")
            if code != 354:
                return code, text
        self.w.write(data)
        return await self.reply()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.w.write(b"QUIT\r\n")
            await asyncio.wait_for(self.reply(), 2)
        self.w.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.w.wait_closed(), 2)


_MAIL = f"MAIL FROM:<{SENDER}>\r\n".encode()
_RCPT = f"RCPT TO:<{RECIPIENT}>\r\n".encode()


@dataclass
class LoadResult:
    sessions: int
    measured: int = 0
    window: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    sent_total: int = 0
    ok_total: int = 0
    duplicates_answered: int = 0
    """250 replies naming a duplicate (smtpguard's ledger answered, nothing relayed)."""
    new_accepted: int = 0
    """250 replies that are not duplicates: each should be exactly one upstream message."""
    dup_keys_sent: int = 0
    first_accept_at: float | None = None
    """time.perf_counter() of the first non-duplicate 250 (warm-up included)."""
    last_accept_at: float | None = None
    errors: Counter[str] = field(default_factory=Counter)
    authenticated: bool = False

    @property
    def rate(self) -> float:
        return self.measured / self.window if self.window > 0 else 0.0

    def count(self, code: int, text: str, at: float) -> None:
        """One final reply: a duplicate answered, a new acceptance (at `at`), or an error."""
        self.sent_total += 1
        if code != 250:
            self.errors[f"{code} {text[:60]}"] += 1
            return
        self.ok_total += 1
        if "duplicate" in text:
            self.duplicates_answered += 1
            return
        self.new_accepted += 1
        if self.first_accept_at is None:
            self.first_accept_at = at
        self.last_accept_at = at

    def percentile(self, p: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        xs = sorted(self.latencies_ms)
        idx = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
        return xs[idx]


async def open_sessions(port: int, n: int, auth: bool, timeout: float = 60) -> list[Session]:
    async def one() -> Session:
        return await Session.open(port, auth)

    # Open in batches, so 50 AUTHs do not all queue on the server's first argon2 verify.
    out: list[Session] = []
    deadline = time.monotonic() + timeout
    first = await asyncio.wait_for(one(), timeout)
    out.append(first)
    while len(out) < n:
        left = deadline - time.monotonic()
        batch = min(50, n - len(out))
        out.extend(await asyncio.wait_for(asyncio.gather(*(one() for _ in range(batch))), max(left, 1)))
    return out


async def run_load(
    port: int,
    sessions: int,
    *,
    auth: bool,
    key_prefix: str,
    warmup: float,
    duration: float,
    max_messages: int,
    size: int = 2000,
    dup_pool: list[str] | None = None,
    dup_ratio: float = 0.0,
    rate: float | None = None,
    pipelining: bool = False,
    seed: int = 1,
    on_window: Callable[[str], None] | None = None,
) -> LoadResult:
    """Drive `sessions` sessions for `warmup` + `duration` seconds (or until `max_messages`
    were measured). `rate` (messages/s over all sessions) paces the sessions instead of
    sending back to back. `on_window("start")` and `on_window("end")` run at the measured
    window's edges (for CPU readings)."""
    body = body_for(size)
    res = LoadResult(sessions)
    conns = await open_sessions(port, sessions, auth)
    res.authenticated = all(c.authenticated for c in conns)
    rng = random.Random(seed)
    t_start = time.perf_counter()
    measure_from = t_start + warmup
    state = {"end": measure_from + duration}
    interval = sessions / rate if rate else 0.0

    async def loop(idx: int, conn: Session) -> None:
        seq = 0
        next_at = time.perf_counter() + (interval * idx / sessions if interval else 0.0)
        while True:
            if interval:
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_at += interval
            t0 = time.perf_counter()
            if t0 >= state["end"]:
                return
            if dup_pool and rng.random() < dup_ratio:
                key = rng.choice(dup_pool)
                res.dup_keys_sent += 1
            else:
                key = f"{key_prefix}:{idx}:{seq}"
                seq += 1
            try:
                pipe = pipelining and "PIPELINING" in conn.caps
                code, text = await conn.send(message_bytes(key, body), pipe)
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                res.errors[f"{type(e).__name__}"] += 1
                return
            t1 = time.perf_counter()
            res.count(code, text, t1)
            if t0 >= measure_from and t1 < state["end"]:
                res.measured += 1
                res.latencies_ms.append((t1 - t0) * 1000)
                if res.measured >= max_messages:
                    state["end"] = t1

    async def edges() -> None:
        if on_window is None:
            return
        await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
        on_window("start")
        # state["end"] moves earlier when max_messages is reached: poll it (bounded).
        for _ in range(int((duration + 5) / 0.02)):
            left = state["end"] - time.perf_counter()
            if left <= 0:
                break
            await asyncio.sleep(min(0.02, left))
        on_window("end")

    edge_task = asyncio.create_task(edges())
    tasks = [asyncio.create_task(loop(i, c)) for i, c in enumerate(conns)]
    hard = warmup + duration + 30
    done, pending = await asyncio.wait(tasks, timeout=hard)
    for t in pending:
        t.cancel()
        res.errors["cancelled at the hard deadline"] += 1
    for t in done:
        if t.exception() is not None:
            res.errors[type(t.exception()).__name__] += 1
    res.window = min(state["end"], time.perf_counter()) - measure_from
    try:
        await asyncio.wait_for(edge_task, 5)
    except TimeoutError:
        res.errors["window edge task timed out"] += 1
    await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    return res


async def deliver_keys(port: int, keys: list[str], sessions: int, auth: bool, size: int = 2000) -> LoadResult:
    """Send each key exactly once (pre-delivery for the duplicate storm)."""
    body = body_for(size)
    res = LoadResult(sessions)
    conns = await open_sessions(port, min(sessions, max(1, len(keys))), auth)
    queue = list(reversed(keys))

    async def loop(conn: Session) -> None:
        while queue:
            key = queue.pop()
            code, text = await conn.send(message_bytes(key, body), False)
            res.count(code, text, time.perf_counter())

    await asyncio.wait_for(asyncio.gather(*(loop(c) for c in conns)), 120)
    await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    return res
