"""The `events.mailbox` listener: an SMTP server that takes DSNs and ARF reports for one
address and applies them like webhooks (§13).

Reports come from other MTAs, which do not authenticate, so this is a listener of its own
and takes no AUTH: it accepts mail for exactly one address, relays nothing, and keeps
nothing but the events read out of a report. A message that is not a report is accepted
(refusing it would make the sender bounce a bounce) and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aiosmtpd.smtp import SMTP, Envelope, Session

from smtpguard.config import MailboxConfig
from smtpguard.events.apply import Applier, log_applied
from smtpguard.events.reports import NotAReport, read_report
from smtpguard.policy.senders import suppression_key
from smtpguard.store import StoreUnavailable

log = logging.getLogger("smtpguard.events")

SOURCE = "mailbox"
"""The source name of events read from the mailbox (in history, reasons and metrics)."""


class ReportHandler:
    def __init__(
        self, cfg: MailboxConfig, applier: Applier, observe: Callable[[str, str, str], None]
    ) -> None:
        self.cfg = cfg
        self.applier = applier
        self.observe = observe
        self._address = suppression_key(cfg.address)

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if suppression_key(address) != self._address:
            return "550 5.1.1 this server takes delivery reports for one address only"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        raw = envelope.original_content or b""
        try:
            events = read_report(raw, SOURCE, self.applier.clock())
        except NotAReport as e:
            self.observe(SOURCE, "-", "not_a_report")
            log.info("mail to the events mailbox is not a report", extra={"reason": str(e)})
            return "250 2.0.0 accepted (not a delivery or feedback report)"
        try:
            for event in events:
                outcome, record = await self.applier.apply(self.cfg.provider, event)
                self.observe(SOURCE, event.kind.value, outcome.value)
                log_applied(SOURCE, event, outcome, record)
        except StoreUnavailable as e:
            log.error("report not applied: store unavailable", extra={"error": str(e)})
            return "451 4.3.0 store unavailable, try again later"
        return "250 2.0.0 report accepted"


class MailboxServer:
    def __init__(
        self, cfg: MailboxConfig, applier: Applier, hostname: str, observe: Callable[[str, str, str], None]
    ) -> None:
        self.cfg = cfg
        self.handler = ReportHandler(cfg, applier, observe)
        self.hostname = hostname
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        host, _, port = self.cfg.listen.rpartition(":")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: SMTP(
                self.handler,
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
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None
