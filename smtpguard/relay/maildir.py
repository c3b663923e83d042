"""The Maildir provider: demos, staging and tests (DESIGN.md §6)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

from smtpguard.config import MaildirProviderConfig
from smtpguard.policy.failover import Attempted
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.relay.base import BeforeData, Envelope, describe, log_unexpected
from smtpguard.replies import Reply


class MaildirProvider:
    idempotent = False
    event_tag: str | None = None
    log: str | None = None
    smtputf8: bool | None = True
    """A file takes any bytes: UTF-8 addresses and headers are written as they came."""

    def __init__(self, cfg: MaildirProviderConfig) -> None:
        self.name = cfg.name
        self.path = cfg.path
        self._seq = 0

    async def close(self) -> None:
        return None

    async def send(self, env: Envelope, before_data: BeforeData) -> Attempted:
        try:
            data = _maildir_message(env)
        except Exception as e:
            # Before the data_sent mark and before any file: nothing can have been written.
            log_unexpected(self.name, "preparing the message", e)
            return Attempted(
                Outcome(Kind.UNAVAILABLE, self.name, detail=f"maildir: {describe(e)}", data_sent=False),
                failover=True,
                health="ok",
            )
        await before_data()
        self._seq += 1
        name = f"{time.time():.6f}.{os.getpid()}_{self._seq}.{socket.gethostname()}"
        try:
            await asyncio.to_thread(_maildir_store, self.path, name, data)
        except _DeliveredButUnsynced as e:
            # In new/ already: a retry would write a second copy.
            return Attempted(
                Outcome(Kind.UNKNOWN, self.name, detail=f"maildir fsync: {e.strerror}"),
                failover=False,
                health="fail",
            )
        except OSError as e:
            # Nothing is in new/ unless the rename happened, and the rename is the last step.
            return Attempted(
                Outcome(Kind.DEFERRED, self.name, Reply(451, "4.3.0", f"maildir: {e.strerror}")),
                failover=False,
                health="fail",
            )
        reply = Reply(250, "2.0.0", f"delivered to maildir as {name}")
        return Attempted(
            Outcome(Kind.DELIVERED, self.name, reply, upstream_id=name, accepted=env.recipients),
            failover=False,
            health="ok",
        )


class _DeliveredButUnsynced(OSError):
    """The message is in new/ but its directory entry may not be on disk yet."""


def _maildir_message(env: Envelope) -> bytes:
    head = f"Return-Path: <{env.sender}>\r\nX-Original-To: {', '.join(env.recipients)}\r\n"
    return head.encode() + env.content


def _maildir_write(root: Path, name: str, env: Envelope) -> None:
    _maildir_store(root, name, _maildir_message(env))


def _maildir_store(root: Path, name: str, data: bytes) -> None:
    for sub in ("tmp", "new", "cur"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    tmp = root / "tmp" / name
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, root / "new" / name)
    try:
        fd = os.open(root / "new", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise _DeliveredButUnsynced(e.errno, e.strerror) from e
