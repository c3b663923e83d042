"""`smtpguard sink`: a local upstream that accepts everything and writes it to a Maildir.

For demos and staging, where a real provider must never be reached.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from smtpguard.config import _host_port
from smtpguard.relay import Envelope as Outbound
from smtpguard.relay import _maildir_write

log = logging.getLogger("smtpguard.sink")


class SinkHandler:
    def __init__(self, maildir: Path) -> None:
        self.maildir = maildir
        self.count = 0

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self.count += 1
        name = f"sink.{self.count}.{id(envelope):x}"
        out = Outbound(
            "sink",
            None,
            name,
            envelope.mail_from or "",
            tuple(envelope.rcpt_tos),
            envelope.original_content or b"",
        )
        await asyncio.to_thread(_maildir_write, self.maildir, name, out)
        return f"250 2.0.0 Ok: queued as {name}"


async def run(listen: str, maildir: Path) -> None:
    host, port = _host_port(listen)
    handler = SinkHandler(maildir)
    loop = asyncio.get_running_loop()

    def factory() -> Any:
        return SMTP(handler, hostname="sink", ident="smtpguard-sink")

    server = await loop.create_server(factory, host=host, port=port)
    print(f"smtpguard sink listening on {listen}, writing to {maildir}/new", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    await server.wait_closed()
