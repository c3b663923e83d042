"""The relay's seam: the envelope one provider is asked to carry, and what a provider is
(DESIGN.md §6). Each kind of provider lives in its own module: smtp.py, maildir.py."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from smtpguard.policy.failover import Attempted
from smtpguard.policy.senders import needs_smtputf8

log = logging.getLogger("smtpguard.relay")

BeforeData = Callable[[], Awaitable[None]]
MarkSent = Callable[["Provider"], Awaitable[None]]
"""The route's data_sent note, told which provider the DATA goes to: its name, the kind of
tag it writes into the message (Provider.event_tag) and the log its api names (log)."""


@dataclass(frozen=True, slots=True)
class Envelope:
    zone: str
    key: str | None
    attempt_id: str
    sender: str
    recipients: tuple[str, ...]
    content: bytes
    smtputf8: bool = False
    """The client declared SMTPUTF8 on MAIL (RFC 6531): its headers may be UTF-8."""

    @property
    def smtputf8_required(self) -> bool:
        """Cannot be relayed without SMTPUTF8: a non-ASCII address (it cannot be written on
        the wire otherwise), or a declared SMTPUTF8 message whose header block is not ASCII
        (RFC 6532 header fields). A declaration the message does not need is dropped for a
        provider that does not offer SMTPUTF8, as Postfix does."""
        if any(needs_smtputf8(a) for a in (self.sender, *self.recipients)):
            return True
        return self.smtputf8 and not self.content.split(b"\r\n\r\n", 1)[0].isascii()

    @property
    def smtputf8_wanted(self) -> bool:
        """Declared to a provider that offers SMTPUTF8: the client declared it, or it is required."""
        return self.smtputf8 or self.smtputf8_required


class Provider(Protocol):
    name: str
    idempotent: bool
    """The provider dedupes on a header we send: an unknown outcome may be retried once."""
    smtputf8: bool | None
    """Whether the provider offers SMTPUTF8, as its last EHLO said; None until it has been
    asked. The listener refuses non-ASCII addresses at MAIL/RCPT only on a known False."""
    event_tag: str | None
    """The kind of tag (policy.tags) it writes into every message it relays, None for none:
    noted with data_sent, so a verdict knows whether the message can be found by it."""
    log: str | None
    """The log its `api` names (policy.verdicts.log_identity), None without one: noted with
    data_sent, so only that log may prove the message absent."""

    async def send(self, env: Envelope, before_data: BeforeData) -> Attempted: ...

    async def close(self) -> None: ...


def log_unexpected(provider: str, stage: str, e: Exception) -> None:
    """An exception outside aiosmtplib's and the OS's is a defect: logged at error with its
    type (and traceback); the expected ones are outcomes and are not logged here."""
    log.error(
        "unexpected %s %s",
        type(e).__name__,
        stage,
        exc_info=e,
        extra={"provider": provider, "error": describe(e)},
    )


def describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:200]
