"""The two reference servers the relay bench compares smtpguard with, each run as its own process:

    python -m bench.servers null PORT
        a bare aiosmtpd listener: accepts AUTH PLAIN without checking it (so the client does
        the same AUTH as with smtpguard), answers 250 to every message, relays nothing.
    python -m bench.servers naive PORT UPSTREAM_PORT POOL_SIZE
        the floor for a Python proxy: the same listener, relaying each message with aiosmtplib
        over a pool of reused upstream connections; no ledger, no store, no policy.

Both use plain asyncio (like smtpguard) and stop on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import warnings
from collections import deque
from typing import Any

import aiosmtplib
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, Session


def _accept_any(server: SMTP, session: Session, envelope: Envelope, mechanism: str, data: Any) -> AuthResult:
    return AuthResult(success=True)


class NullHandler:
    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        return "250 2.0.0 Ok: discarded"


class NaiveRelay:
    def __init__(self, upstream_port: int, pool_size: int) -> None:
        self.port = upstream_port
        self.idle: deque[aiosmtplib.SMTP] = deque()
        self.slots = asyncio.Semaphore(pool_size)

    async def _conn(self) -> aiosmtplib.SMTP:
        while self.idle:
            conn = self.idle.pop()
            if conn.is_connected:
                return conn
            conn.close()
        conn = aiosmtplib.SMTP(hostname="127.0.0.1", port=self.port, start_tls=False, timeout=10)
        await conn.connect()
        return conn

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        async with self.slots:
            conn = await self._conn()
            try:
                _, text = await conn.sendmail(
                    envelope.mail_from or "", list(envelope.rcpt_tos), envelope.original_content or b""
                )
            except aiosmtplib.SMTPResponseException as e:
                conn.close()
                return f"{e.code} {e.message}"
            except (aiosmtplib.SMTPException, OSError, TimeoutError) as e:
                conn.close()
                return f"451 4.4.1 upstream: {type(e).__name__}"
            self.idle.append(conn)
            return f"250 2.0.0 {text}"


async def serve(port: int, handler: object) -> None:
    loop = asyncio.get_running_loop()

    def make() -> SMTP:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SMTP(
                handler,
                hostname="bench-ref.invalid",
                authenticator=_accept_any,
                auth_required=False,
                auth_require_tls=False,
                decode_data=False,
                data_size_limit=25_000_000,
            )

    srv = await loop.create_server(make, "127.0.0.1", port, reuse_address=True, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    srv.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(srv.wait_closed(), 2)
    if isinstance(handler, NaiveRelay):
        for conn in handler.idle:
            conn.close()


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "null":
        asyncio.run(serve(int(argv[1]), NullHandler()))
        return 0
    if len(argv) >= 4 and argv[0] == "naive":

        async def run() -> None:
            await serve(int(argv[1]), NaiveRelay(int(argv[2]), int(argv[3])))

        asyncio.run(run())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
