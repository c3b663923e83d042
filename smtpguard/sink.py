"""`smtpguard sink`: a local upstream that accepts everything and writes it to a Maildir.

For demos and staging, where a real provider must never be reached. A message is never
written over another: names carry the time, the process id and a random part (a restarted
sink starts its counter again), the file is created exclusively in tmp/, and it is linked
into new/, which fails on an existing name instead of replacing it the way rename would
(where hard links are not possible, new/ is written directly, created exclusively).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from smtpguard.config import _host_port
from smtpguard.relay import Envelope as Outbound
from smtpguard.relay import _maildir_message

log = logging.getLogger("smtpguard.sink")


def unique_name(count: int) -> str:
    """A Maildir name in the usual time.unique.host form, unique across restarts."""
    now = time.time_ns()
    host = socket.gethostname().replace("/", "\\057").replace(":", "\\072")
    return f"{now // 10**9}.M{now // 1000 % 10**6}P{os.getpid()}Q{count}R{secrets.token_hex(4)}.{host}"


def prepare(maildir: Path) -> None:
    for sub in ("tmp", "new", "cur"):
        (maildir / sub).mkdir(parents=True, exist_ok=True)


def _create(path: Path, data: bytes) -> bool:
    """Write `data` to a new file at `path`, synced; False (nothing written) if it exists."""
    try:
        with open(path, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except FileExistsError:
        return False
    return True


def deliver(maildir: Path, name: str, data: bytes) -> bool:
    """Write `data` as new/`name`; False (nothing written) if that name exists already."""
    tmp = maildir / "tmp" / name
    if not _create(tmp, data):
        return False
    try:
        os.link(tmp, maildir / "new" / name)
    except FileExistsError:
        return False
    except OSError:
        # No hard links here (a filesystem without them, or tmp/ and new/ on two devices):
        # create the name exclusively in new/ and write it there. Still never over another
        # message; a reader may see the file before it is complete.
        return _create(maildir / "new" / name, data)
    finally:
        tmp.unlink()
    return True


class SinkHandler:
    def __init__(self, maildir: Path, names: Callable[[int], str] = unique_name) -> None:
        self.maildir = maildir
        self.names = names
        self.count = 0

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        out = Outbound(
            "sink",
            None,
            "sink",
            envelope.mail_from or "",
            tuple(envelope.rcpt_tos),
            envelope.original_content or b"",
        )
        data = _maildir_message(out)
        while True:
            self.count += 1
            name = self.names(self.count)
            if await asyncio.to_thread(deliver, self.maildir, name, data):
                return f"250 2.0.0 Ok: queued as {name}"
            log.warning("sink: name taken, choosing another", extra={"file": name})


async def run(listen: str, maildir: Path) -> None:
    host, port = _host_port(listen)
    # At start, not at the first message: a Maildir that cannot be made is an error now.
    prepare(maildir)
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
