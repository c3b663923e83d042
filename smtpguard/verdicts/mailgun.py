"""Mailgun's Events API: GET {base_url}/v3/DOMAIN/events, HTTP Basic `api:KEY`.

Documented at https://documentation.mailgun.com/docs/mailgun/api-reference/send/mailgun/events
and https://documentation.mailgun.com/docs/mailgun/user-manual/events/ (time range, filter
expressions, paging): filters `message-id` (the Message-ID without <>), `event` (a filter
expression: `accepted OR rejected`), `begin`/`end` in epoch seconds, `limit` (at most 300);
the answer is `{"items": [...], "paging": {"next": URL, ...}}`, and the range is traversed by
requesting `paging.next` until a page comes back empty.

An item's `event`: `accepted` (Mailgun took the message), `rejected` (refused at acceptance,
with `reject.reason`); `failed` with `severity: permanent`, `complained`, `unsubscribed` for
reconciliation. smtpguard's tag is `user-variables.smtpguard_key` (X-Mailgun-Variables).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import Any

from smtpguard.policy.events import KEY_FIELD, Match, ProviderEvent, strs
from smtpguard.policy.verdicts import (
    Attempt,
    LogEntry,
    LogKind,
    bare_message_id,
    searchable_message_id,
    window,
)
from smtpguard.verdict_config import MailgunApi, PostmarkApi, SendgridApi
from smtpguard.verdicts.http import ApiClient, ApiTruncated, field
from smtpguard.verdicts.model import Reported, api_source, parse_time

PAGE = 300
MAX_PAGES = 10
_KINDS = {"accepted": LogKind.ACCEPTED, "rejected": LogKind.REFUSED}


def _following(body: Any, _n: int) -> tuple[str, None] | None:
    nxt = field(body, "paging", "next")
    # Mailgun's last page is the empty one; its `next` is always present.
    return (nxt, None) if isinstance(nxt, str) and field(body, "items") else None


class MailgunLog(ApiClient):
    kind = "mailgun"

    def __init__(self, *, domain: str, **kw: Any) -> None:
        self.domain = domain  # before the base's __init__, which names the log by it
        super().__init__(**kw)

    def log_domain(self) -> str | None:
        return self.domain

    @classmethod
    def config_keywords(cls, api: MailgunApi | PostmarkApi | SendgridApi) -> dict[str, Any]:
        assert isinstance(api, MailgunApi)  # from_config took only a mailgun api
        return {"domain": api.domain}

    def credential_header(self, key: str) -> tuple[str, str]:
        return "Authorization", "Basic " + base64.b64encode(f"api:{key}".encode()).decode("ascii")

    @property
    def _path(self) -> str:
        return f"/v3/{self.domain}/events"

    async def _items(
        self, params: Mapping[str, str], max_pages: int = MAX_PAGES, whole: bool = False
    ) -> list[Any]:
        items, complete = await self._read(params, max_pages)
        if whole and not complete:
            raise ApiTruncated(f"{self.provider}: more than {max_pages} pages in the range asked for")
        return items

    async def _read(self, params: Mapping[str, str], max_pages: int = MAX_PAGES) -> tuple[list[Any], bool]:
        """The items of the first `max_pages` pages, and whether they were all there is."""
        out: list[Any] = []
        try:
            async for body in self.pages((self._path, params), _following, max_pages, whole=True):
                out.extend(self.need_list(body, "items"))
        except ApiTruncated:
            return out, False
        return out, True

    async def entries(self, attempt: Attempt) -> list[LogEntry]:
        if attempt.tag is None and attempt.message_id is None:
            return []  # nothing could match: not worth ten pages of the window
        first, last = window(attempt)
        params = {
            "begin": f"{first:.0f}",
            "end": f"{last:.0f}",
            "event": "accepted OR rejected",
            "limit": str(PAGE),
        }
        # A field that is not one plain msg-id is not searched by as written (Mailgun logs
        # the msg-id alone): the window is read, and the message is found by its tag.
        mid = searchable_message_id(attempt.message_id)
        if mid is not None:
            params["message-id"] = mid
        # A Message-ID an application writes on every message can fill more pages than one
        # look reads: what was read is then judged as a part (ApiClient.partial_look).
        items, whole = await self._read(params)
        entries = [e for e in (self._entry(item, strict=True) for item in items) if e is not None]
        return entries if whole else self.partial_look(attempt, entries)

    async def accepted_since(self, at: float) -> list[LogEntry]:
        # One accepted event per recipient: a page of 100, so a message to many recipients
        # (all ours, no proof) does not hide the next message's acceptance.
        params = {"begin": f"{at:.0f}", "ascending": "yes", "event": "accepted", "limit": "100"}
        return [e for e in map(self._entry, await self._items(params, max_pages=1)) if e is not None]

    async def reported_since(self, since: float, until: float) -> list[ProviderEvent]:
        params = {
            "begin": f"{since:.0f}",
            "end": f"{until:.0f}",
            "event": "failed OR complained OR unsubscribed",
            "limit": str(PAGE),
        }
        return [r for r in map(self._reported, await self._items(params, whole=True)) if r is not None]

    def _entry(self, item: Any, strict: bool = False) -> LogEntry | None:
        kind = _KINDS.get(str(field(item, "event")))
        at = parse_time(field(item, "timestamp"))
        if kind is not None and at is None and strict:
            raise self.untimed()
        if kind is None or at is None:
            return None
        mid = field(item, "message", "headers", "message-id")
        tag = field(item, "user-variables", KEY_FIELD)
        reason = field(item, "reject", "reason") if kind is LogKind.REFUSED else None
        return LogEntry(
            provider=self.provider,
            kind=kind,
            at=at,
            message_id=mid if isinstance(mid, str) else None,
            tag=tag if isinstance(tag, str) else None,
            # Mailgun names a message by its Message-ID; its 250 carries no other id.
            upstream_id=bare_message_id(mid) if isinstance(mid, str) else None,
            reason=reason if isinstance(reason, str) else "",
        )

    def _reported(self, item: Any) -> ProviderEvent | None:
        event = str(field(item, "event"))
        if event == "failed":
            if field(item, "severity") != "permanent":
                return None
            kind = Reported.BOUNCE
        elif event == "complained":
            kind = Reported.COMPLAINT
        elif event == "unsubscribed":
            kind = Reported.UNSUBSCRIBE
        else:
            return None
        recipient, at = field(item, "recipient"), parse_time(field(item, "timestamp"))
        if not isinstance(recipient, str) or at is None:
            return None
        mid = field(item, "message", "headers", "message-id")
        tag = field(item, "user-variables", KEY_FIELD)
        ident = field(item, "id")
        if not isinstance(ident, str):
            ident = hashlib.sha256(f"{event}|{recipient}|{at}|{mid}".encode()).hexdigest()[:32]
        # Spelt as Mailgun's webhook spells the same event (events/sources/mailgun.py), so
        # the history and the suppression reason read the same whichever way it came.
        code = field(item, "delivery-status", "enhanced-code") or field(item, "delivery-status", "code")
        return ProviderEvent(
            source=api_source(self.provider),
            kind=kind,
            provider_type="failed/permanent" if event == "failed" else event,
            recipient=recipient,
            status=str(code) if code is not None else "",
            at=at,
            event_id=ident,
            match=Match(
                keys=strs(tag),
                message_ids=strs(mid),
                upstream_ids=strs(bare_message_id(mid) if isinstance(mid, str) else None),
            ),
        )
