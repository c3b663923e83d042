"""The `events.mailbox` listener: an SMTP server that takes DSNs and ARF reports for one
address and applies them like webhooks (§13).

Reports come from other MTAs, which do not authenticate, so this is a listener of its own
and takes no AUTH: it accepts mail for exactly one address, relays nothing, and keeps
nothing but the events read out of a report. A message that is not a report is accepted
(refusing it would make the sender bounce a bounce) and counted.

An MX takes mail from anyone, so a report proves nothing by what it quotes. It has effects
only when mailed to the VERP address its message left with (`b+TOKEN@DOMAIN`, DESIGN.md
§18) and only for that message's recipients; anything else is history marked `unverified`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from aiosmtpd.smtp import SMTP, Envelope, Session

from smtpguard import replies
from smtpguard.admission import Admission, ListenerLimits, WriteDeadline, WriteDeadlineProtocol, peer_ip
from smtpguard.closing import close_server
from smtpguard.config import MailboxConfig
from smtpguard.events.apply import Applied, Applier, log_applied
from smtpguard.events.reports import NotAReport, read_report
from smtpguard.policy import verp
from smtpguard.policy.events import Match, ProviderEvent
from smtpguard.policy.ledger import Record
from smtpguard.policy.senders import recipient_tag, suppression_key
from smtpguard.policy.sends import sent_as
from smtpguard.smtp_session import LimitedSession
from smtpguard.store import StoreUnavailable
from smtpguard.verp import VerpKey

log = logging.getLogger("smtpguard.events")

SOURCE = "mailbox"
"""The source name of events read from the mailbox (in history, reasons and metrics)."""
MAX_RECIPIENTS = 100
"""Recipients one message may have here: a report is mailed to one address, and RFC 5321
§4.5.3.1.8 asks no server to take more than 100. Without a limit a session repeating RCPT
grows its envelope without end, each command well within its deadline."""


@dataclass(eq=False, repr=False)
class ReportHandler:
    cfg: MailboxConfig
    applier: Applier
    observe: Callable[[str, str, str], None]
    key: VerpKey | None = None
    max_recipients: Callable[[], int] = lambda: 100
    """limits.max_recipients as now configured: a report naming more is read that far."""
    _address: str = field(init=False)

    def __post_init__(self) -> None:
        self._address = suppression_key(self.cfg.address)

    def _addressed(self, address: str) -> verp.Addressed:
        if self.key is None:
            return verp.Addressed(False)
        return verp.read_address(address, self.key.domain, self.key.secret)

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        # A VERP address is taken whether or not its token verifies: a report to a bad
        # token joins the history as unverified, and refusing it would bounce a bounce.
        if len(envelope.rcpt_tos) >= MAX_RECIPIENTS:
            return str(replies.too_many_recipients(MAX_RECIPIENTS))
        if suppression_key(address) != self._address and not self._addressed(address).verp:
            return "550 5.1.1 this server takes delivery reports for one address only"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        raw = envelope.original_content or b""
        try:
            # A megabyte of MIME is a few hundred ms of CPU, and anyone can mail one: read it
            # off the event loop, which every listener of this process shares.
            events = await asyncio.to_thread(
                read_report, raw, SOURCE, self.applier.clock(), self.max_recipients()
            )
        except NotAReport as e:
            self.observe(SOURCE, "-", "not_a_report")
            log.info("mail to the events mailbox is not a report", extra={"reason": str(e)})
            return "250 2.0.0 accepted (not a delivery or feedback report)"
        tokens = {a.sg_id for a in map(self._addressed, envelope.rcpt_tos) if a.sg_id is not None}
        provider = self.cfg.provider
        retry = False
        try:
            # One verified token names the record; anything else (no token, a tampered one,
            # two that disagree) falls back to the ids the report quotes, which anyone who
            # saw the message can quote: history only.
            verified = await self._record_of(tokens.pop(), events[0].match) if len(tokens) == 1 else None
            # Every event of a report quotes the same headers: one lookup for all of them.
            found = verified if verified is not None else await self.applier.find(provider, events[0].match)
            for event in events:
                trusted = verified is not None and _was_recipient(verified, event)
                outcome, record = await self.applier.apply_to(provider, found, event, trusted=trusted)
                retry = retry or outcome is Applied.RETRY_LATER
                self.observe(SOURCE, event.kind.value, outcome.value)
                log_applied(SOURCE, event, outcome, record)
        except StoreUnavailable as e:
            log.error("report not applied: store unavailable", extra={"error": str(e)})
            return "451 4.3.0 store unavailable, try again later"
        if retry:
            # Its message's outcome is not written yet: the reporting MTA retries later, and
            # what was applied now counts as a duplicate then.
            return "451 4.3.2 the reported message is still being sent, try again later"
        return "250 2.0.0 report accepted"

    async def _record_of(self, sg_id: str, match: Match) -> Record | None:
        """The record whose attempt `sg_id` (a token that verified) was."""
        found = [r for r in await self.applier.store.records_for_event("sg_id", sg_id) if r.sg_id == sg_id]
        if len(found) == 1:
            return found[0]
        # An earlier attempt (a retry, or a derived key's new event, has a new sg id): the
        # token proves the attempt was smtpguard's, and the record the report quotes is
        # taken only if its own history holds that attempt.
        quoted = await self.applier.find(self.cfg.provider, match)
        return quoted if quoted is not None and sent_as(quoted, sg_id) else None


def _was_recipient(record: Record, event: ProviderEvent) -> bool:
    """A report at a verified token suppresses only an address that message was sent to."""
    if event.recipient is None:
        return True
    return recipient_tag(event.recipient) in record.rcpt_tags


class _MailboxSMTP(WriteDeadlineProtocol, LimitedSession):
    """aiosmtpd's SMTP for one mailbox connection, admitted and timed by its listener
    (DESIGN.md §18): idle_timeout between commands, read_timeout from a command's (or a
    message's) first byte to its end, however slowly it trickles; and Postfix's error and
    junk command limits (smtp_session.py), or a NOOP each few seconds would hold it."""

    log = log
    recipient_refusals_count = True

    def __init__(
        self, handler: ReportHandler, admission: Admission, limits: ListenerLimits, **kw: Any
    ) -> None:
        self._admission = admission
        self._limits = limits
        self._bucket: str | None = None
        self._refused = False
        self._reading = False
        super().__init__(handler, timeout=limits.idle_timeout, **kw)
        self._writing = WriteDeadline(self.loop, limits.read_timeout, self._not_reading)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is None and self._bucket is None:
            bucket = self._admission.admit(peer_ip(transport))
            if bucket is None:
                self._refused = True
                cast(asyncio.Transport, transport).write(f"{replies.GREETING_BUSY}\r\n".encode())
                transport.close()
                return
            self._bucket = bucket
        super().connection_made(transport)

    def connection_lost(self, error: Exception | None) -> None:
        if self._refused:
            return
        if self._bucket is not None:
            self._admission.release(self._bucket)
            self._bucket = None
        self._writing.resumed()
        super().connection_lost(error)

    def _not_reading(self) -> None:
        log.info(
            "events mailbox: replies not taken within read_timeout",
            extra={"client_ip": peer_ip(self.transport) if self.transport else "?"},
        )
        if self.transport is not None:
            # Not close(), as aiosmtpd's timeout does: it waits for the replies to be read.
            cast(asyncio.Transport, self.transport).abort()

    def eof_received(self) -> bool | None:
        if self._refused:
            return None
        result: bool | None = super().eof_received()
        return result

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if data and not self._reading and self.transport is not None:
            self._reading = True
            self._reset_timeout(self._limits.read_timeout)
        super().data_received(data)

    def _reset_timeout(self, duration: float | None = None) -> None:
        # aiosmtpd calls this without a duration at connect and after each command line:
        # the connection is between commands, so idle_timeout.
        if duration is None:
            self._reading = False
        super()._reset_timeout(duration)

    def _set_post_data_state(self) -> None:
        super()._set_post_data_state()  # type: ignore[no-untyped-call]
        # The message is in and answered: the client is between commands again.
        self._reset_timeout()

    def _timeout_cb(self) -> None:
        log.info(
            "events mailbox: connection timed out",
            extra={"client_ip": peer_ip(self.transport) if self.transport else "?", "reading": self._reading},
        )
        if self.transport is not None and not self.transport.is_closing():
            cast(asyncio.Transport, self.transport).write(f"{replies.IDLE_TIMEOUT}\r\n".encode())
        super()._timeout_cb()  # type: ignore[no-untyped-call]


class MailboxServer:
    """The mailbox's SMTP listener, answering as `hostname`; `handler` reads what it is sent."""

    def __init__(self, handler: ReportHandler, hostname: str) -> None:
        self.cfg = handler.cfg
        self.handler = handler
        self.hostname = hostname
        self.admission = Admission(self.cfg, "events.mailbox", log.name)
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        host, _, port = self.cfg.listen.rpartition(":")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _MailboxSMTP(
                self.handler,
                self.admission,
                self.cfg,
                hostname=self.hostname,
                ident="smtpguard events mailbox",
                data_size_limit=self.cfg.max_message_size,
                auth_required=False,
            ),
            host.strip("[]"),
            int(port),
            reuse_address=True,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            await close_server(self._server)
            self._server = None
