"""SendGrid's Email Activity and suppression APIs, `Authorization: Bearer KEY`.

Documented at https://www.twilio.com/docs/sendgrid/api-reference/email-activity/filter-all-messages
(GET /v3/messages with `query` and `limit` (at most 1000); answer `{"messages": [...]}`, each
with `msg_id`, `status` (processed, delivered, not_delivered), `last_event_time`),
https://www.twilio.com/docs/sendgrid/api-reference/email-activity/filter-messages-by-message-id
(GET /v3/messages/{msg_id}: `events` with `event_name` and `processed`, and `unique_args`),
https://www.twilio.com/docs/sendgrid/for-developers/sending-email/getting-started-email-activity-api
(the query language: `unique_args['NAME']="VALUE"`, `last_event_time BETWEEN TIMESTAMP "…" AND
TIMESTAMP "…"`) and https://www.twilio.com/docs/sendgrid/api-reference/bounces-api/retrieve-all-bounces,
…/spam-reports-api/retrieve-all-spam-reports,
…/suppressions-global-suppressions/retrieve-all-global-suppressions
(GET /v3/suppression/{bounces,spam_reports,unsubscribes} with `start_time`, `end_time` in
epoch seconds, `limit`, `offset`; answer a list of `{created, email, reason?, status?}`).

The list answer shows neither the send time nor smtpguard's tag, and `last_event_time` may be
hours after the send (a deferred delivery): each candidate's details give the `processed`
time (what the ±10 min window is about), the tag and whether it was `dropped`. SendGrid allows
6 Email Activity requests a minute, so at most MAX_DETAILS candidates are read per look.
"""

from __future__ import annotations

import hashlib
from typing import Any

from smtpguard.policy.events import KEY_FIELD, ProviderEvent
from smtpguard.policy.verdicts import Attempt, LogEntry, LogKind
from smtpguard.verdicts.http import ApiClient, ApiMalformed, ApiNotFound, field
from smtpguard.verdicts.model import Reported, api_source, iso_utc, parse_time

MAX_DETAILS = 3
LIST_LIMIT = 10
"""Rows of a tag's search asked for: as many as that are taken to mean there may be more."""
PAGE = 500
MAX_PAGES = 10
_SUPPRESSIONS = {
    "bounces": Reported.BOUNCE,
    "spam_reports": Reported.COMPLAINT,
    "unsubscribes": Reported.UNSUBSCRIBE,
}


def _quoted(value: str) -> str:
    # The query language quotes with "; a tag is smtpguard's own and ASCII, but a quote in a
    # key must not end the string early.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class SendgridLog(ApiClient):
    kind = "sendgrid"

    def credential_header(self, key: str) -> tuple[str, str]:
        return "Authorization", "Bearer " + key

    async def entries(self, attempt: Attempt) -> list[LogEntry]:
        if attempt.tag is None:
            return []  # Email Activity cannot be searched by Message-ID
        query = f"unique_args['{KEY_FIELD}']={_quoted(attempt.tag)}"
        body = await self.get_json("/v3/messages", {"query": query, "limit": str(LIST_LIMIT)})
        listed = self.need_list(body, "messages")
        out: list[LogEntry] = []
        for msg in listed[:MAX_DETAILS]:
            entry = await self._details(msg, strict=True)
            if entry is not None:
                out.append(entry)
        # SendGrid lists a message once per recipient: the details left unread (or rows past
        # the list's limit) may hold the acceptance that outweighs the drops read.
        if len(listed) > MAX_DETAILS or len(listed) >= LIST_LIMIT:
            return self.partial_look(attempt, out)
        return out

    async def accepted_since(self, at: float) -> list[LogEntry]:
        query = f'last_event_time BETWEEN TIMESTAMP "{iso_utc(at)}" AND TIMESTAMP "{iso_utc(self._wall())}"'
        body = await self.get_json("/v3/messages", {"query": query, "limit": "10"})
        for msg in self.need_list(body, "messages")[:MAX_DETAILS]:
            entry = await self._details(msg)
            if entry is not None and entry.kind is LogKind.ACCEPTED and entry.at > at:
                return [entry]
        return []

    async def _details(self, msg: Any, strict: bool = False) -> LogEntry | None:
        """The message's entry from its details. `strict` (a search by the record's tag): a
        `processed` event whose time cannot be read makes the look malformed, as Mailgun's
        and Postmark's do, rather than dropping what may be the message's acceptance."""
        msg_id = field(msg, "msg_id")
        if not isinstance(msg_id, str) or not msg_id or "/" in msg_id:
            return None
        try:
            detail = await self.get_json(f"/v3/messages/{msg_id}")
        except ApiNotFound:
            return None  # listed before its details are: the next look reads them
        events = self.need_list(detail, "events")
        processed = [
            parse_time(field(e, "processed")) for e in events if field(e, "event_name") == "processed"
        ]
        if strict and None in processed:
            raise self.untimed()
        times = [t for t in processed if t is not None]
        dropped = next((e for e in events if field(e, "event_name") == "dropped"), None)
        if not times and dropped is None:
            return None
        at = min(times) if times else parse_time(field(dropped, "processed"))
        if at is None:
            raise ApiMalformed(f"{self.provider}: message details without an event time")
        tag = field(detail, "unique_args", KEY_FIELD)
        reason = field(dropped, "reason") if dropped is not None else None
        return LogEntry(
            provider=self.provider,
            kind=LogKind.DROPPED if dropped is not None else LogKind.ACCEPTED,
            at=at,
            tag=tag if isinstance(tag, str) else None,
            upstream_id=msg_id,
            reason=reason if isinstance(reason, str) else "",
        )

    async def reported_since(self, since: float, until: float) -> list[ProviderEvent]:
        out: list[ProviderEvent] = []
        for name, kind in _SUPPRESSIONS.items():
            path = f"/v3/suppression/{name}"
            params = {"start_time": f"{since:.0f}", "end_time": f"{until:.0f}", "limit": str(PAGE)}

            def following(body: Any, n: int, path: str = path, params: dict[str, str] = params) -> Any:
                return (path, {**params, "offset": str(n * PAGE)}) if len(body) >= PAGE else None

            async for body in self.pages((path, {**params, "offset": "0"}), following, MAX_PAGES, True):
                for row in self.need_list(body, None):
                    event = self._reported(row, name, kind)
                    if event is not None:
                        out.append(event)
        return out

    def _reported(self, row: Any, name: str, kind: Reported) -> ProviderEvent | None:
        email, at = field(row, "email"), parse_time(field(row, "created"))
        if not isinstance(email, str) or at is None:
            return None
        status = field(row, "status")
        # The suppression lists give no event id: one made of the entry names it.
        ident = hashlib.sha256(f"sendgrid|{name}|{email.lower()}|{at:.0f}".encode()).hexdigest()[:32]
        return ProviderEvent(
            source=api_source(self.provider),
            kind=kind,
            provider_type=name,
            recipient=email,
            status=status if isinstance(status, str) else "",
            at=at,
            event_id=ident,
        )
