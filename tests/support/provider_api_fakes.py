"""Local fakes of three providers' log APIs: real aiohttp servers on loopback that follow the
documented request and response shapes, and refuse what the provider would refuse.

- Mailgun Events API, https://documentation.mailgun.com/docs/mailgun/api-reference/openapi-final/tag/Events
  and https://documentation.mailgun.com/docs/mailgun/user-manual/events/: Basic `api:KEY`;
  `begin`/`end` epoch seconds, `ascending`, `limit` ≤ 300, `event` (filter expression with
  OR), `message-id`; pages through `paging.next` until an empty page.
- Postmark Messages and Bounces APIs, https://postmarkapp.com/developer/api/messages-api and
  https://postmarkapp.com/developer/api/bounce-api: `X-Postmark-Server-Token`; `count` ≤ 500
  and `offset` required (422 otherwise), offset + count ≤ 10,000; `recipient`,
  `fromdate`/`todate` read in US Eastern time, `metadata_NAME=VALUE`; newest first.
- SendGrid Email Activity and suppression APIs,
  https://www.twilio.com/docs/sendgrid/api-reference/email-activity/filter-all-messages,
  …/filter-messages-by-message-id, …/bounces-api: `Authorization: Bearer KEY`; `query`
  required, `limit` 1 to 1000; the query terms `unique_args['NAME']="V"`, `msg_id="V"`,
  `last_event_time BETWEEN TIMESTAMP "A" AND TIMESTAMP "B"` joined by AND (anything else is
  400); suppression lists with `start_time`, `end_time`, `limit`, `offset`.

Every fake: a wrong or missing credential is 401 in the provider's own body; `fail(status,
times, retry_after)` answers the next requests with that status (429 with `Retry-After`,
500); an entry added with `delay` becomes visible only that many seconds later on the fake's
clock (eventual consistency); `stall` delays every answer (a slow API); `requests` records
what was asked and when, `most_in_flight` how many requests were open at once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from aiohttp import web

EASTERN = timezone(timedelta(hours=-5))
"""Postmark reads fromdate/todate in US Eastern time (fixed here at -05:00)."""


@dataclass
class Seen:
    path: str
    query: dict[str, str]
    at: float
    """time.monotonic() when the request arrived."""
    authorised: bool


@dataclass
class Stored:
    item: dict[str, Any]
    at: float
    visible_at: float
    meta: dict[str, Any] = field(default_factory=dict)


class FakeApi:
    """What the three fakes share: server lifecycle, auth, faults, visibility, the request log."""

    def __init__(self, key: str, clock: Callable[[], float] = time.time) -> None:
        self.key = key
        self.clock = clock
        self.requests: list[Seen] = []
        self._faults: list[tuple[int, str | None]] = []
        self.stall = 0.0
        """Seconds every answer waits before it is written (a slow or hung API)."""
        self.in_flight = 0
        self.most_in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def authorised(self, request: web.Request) -> bool:
        raise NotImplementedError

    def unauthorised(self) -> web.Response:
        raise NotImplementedError

    def error(self, status: int, message: str) -> web.Response:
        return web.json_response({"message": message}, status=status)

    async def start(self) -> FakeApi:
        app = web.Application(middlewares=[self._gate])
        self.routes(app)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)  # a stalled answer never holds stop()
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def fail(self, status: int, times: int = 1, retry_after: str | None = None) -> None:
        self._faults.extend([(status, retry_after)] * times)

    def visible(self, stored: list[Stored]) -> list[Stored]:
        now = self.clock()
        return [s for s in stored if s.visible_at <= now]

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        ok = self.authorised(request)
        self.requests.append(Seen(request.path, dict(request.query), time.monotonic(), ok))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.stall:
                await asyncio.sleep(self.stall)
            return await self._answer_gated(request, handler, ok)
        finally:
            self.in_flight -= 1

    async def _answer_gated(self, request: web.Request, handler: Any, ok: bool) -> web.StreamResponse:
        if not ok:
            return self.unauthorised()
        if self._faults:
            status, retry_after = self._faults.pop(0)
            headers = {"Retry-After": retry_after} if retry_after is not None else {}
            return web.json_response({"message": "fault on demand"}, status=status, headers=headers)
        response: web.StreamResponse = await handler(request)
        return response


def _int(request: web.Request, name: str, default: int | None = None) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name} must be an integer")
    return int(raw)


# --- Mailgun -------------------------------------------------------------------------------
class FakeMailgun(FakeApi):
    def __init__(self, key: str, domain: str, clock: Callable[[], float] = time.time) -> None:
        super().__init__(key, clock)
        self.domain = domain
        self.events: list[Stored] = []

    def add(
        self,
        event: str,
        at: float,
        *,
        message_id: str,
        tag: str | None = None,
        recipient: str = "rcpt@example.com",
        reason: str = "",
        severity: str | None = None,
        delay: float = 0.0,
    ) -> dict[str, Any]:
        item: dict[str, Any] = {
            "event": event,
            "id": uuid.uuid4().hex[:22],
            "timestamp": at,
            "log-level": "warn" if event in ("rejected", "failed") else "info",
            "flags": {"is-test-mode": False},
            "message": {
                "headers": {
                    "to": recipient,
                    "message-id": message_id.strip("<>"),
                    "from": f"billing@{self.domain}",
                    "subject": "Invoice",
                },
                "attachments": [],
                "size": 809,
            },
            "user-variables": {"smtpguard_key": tag} if tag is not None else {},
        }
        if event != "rejected":
            item["recipient"] = recipient
        if event == "rejected":
            item["reject"] = {"reason": reason, "description": ""}
        if event == "failed":
            item["severity"] = severity or "permanent"
            item["delivery-status"] = {"code": 550, "message": reason}
        self.events.append(Stored(item, at, self.clock() + delay))
        return item

    def authorised(self, request: web.Request) -> bool:
        want = "Basic " + base64.b64encode(f"api:{self.key}".encode()).decode()
        return request.headers.get("Authorization") == want

    def unauthorised(self) -> web.Response:
        return web.Response(status=401, text="Forbidden")

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v3/{domain}/events", self._first)
        app.router.add_get("/v3/{domain}/events/{page}", self._page)

    async def _first(self, request: web.Request) -> web.Response:
        if request.match_info["domain"] != self.domain:
            return self.error(404, "Domain not found")
        try:
            limit = _int(request, "limit", 100)
            assert limit is not None
            if not 1 <= limit <= 300:
                raise ValueError("limit must be within 1 and 300")
            begin = float(request.query["begin"]) if "begin" in request.query else None
            end = float(request.query["end"]) if "end" in request.query else None
        except ValueError as e:
            return self.error(400, str(e))
        ascending = request.query.get("ascending")
        if end is None and begin is not None and ascending not in ("yes", "no"):
            return self.error(400, "ascending must be provided if the range end is not specified")
        state = {
            "begin": begin,
            "end": end,
            "ascending": ascending == "yes" if end is None or begin is None else end >= begin,
            "limit": limit,
            "event": request.query.get("event"),
            "message-id": request.query.get("message-id"),
            "offset": 0,
        }
        return self._answer(request, state)

    async def _page(self, request: web.Request) -> web.Response:
        try:
            state = json.loads(base64.urlsafe_b64decode(request.match_info["page"]))
        except ValueError:
            return self.error(400, "bad page")
        return self._answer(request, state)

    def _answer(self, request: web.Request, state: dict[str, Any]) -> web.Response:
        begin, end = state["begin"], state["end"]
        low, high = (begin, end) if state["ascending"] else (end, begin)
        events = {e.strip() for e in state["event"].split(" OR ")} if state["event"] else None
        rows = [
            s
            for s in self.visible(self.events)
            if (low is None or s.at >= low)
            and (high is None or s.at <= high)
            and (events is None or s.item["event"] in events)
            and (
                state["message-id"] is None
                or s.item["message"]["headers"]["message-id"] == state["message-id"]
            )
        ]
        rows.sort(key=lambda s: s.at, reverse=not state["ascending"])
        page = rows[state["offset"] : state["offset"] + state["limit"]]
        nxt = base64.urlsafe_b64encode(json.dumps({**state, "offset": state["offset"] + len(page)}).encode())
        first = base64.urlsafe_b64encode(json.dumps({**state, "offset": 0}).encode())
        url = f"{self.base_url}/v3/{self.domain}/events/"
        paging = {
            "previous": url + first.decode(),
            "first": url + first.decode(),
            "last": url + nxt.decode(),
            "next": url + nxt.decode(),
        }
        return web.json_response({"items": [s.item for s in page], "paging": paging})


# --- Postmark ------------------------------------------------------------------------------
def _postmark_date(value: str) -> float:
    when = datetime.fromisoformat(value)
    if when.tzinfo is None:
        when = when.replace(tzinfo=EASTERN)
    return when.timestamp()


class FakePostmark(FakeApi):
    def __init__(self, key: str, clock: Callable[[], float] = time.time) -> None:
        super().__init__(key, clock)
        self.messages: list[Stored] = []
        self.bounces: list[Stored] = []

    def add_message(
        self,
        at: float,
        *,
        tag: str | None = None,
        recipient: str = "rcpt@example.com",
        message_id: str | None = None,
        delay: float = 0.0,
    ) -> dict[str, Any]:
        received = datetime.fromtimestamp(at, EASTERN).isoformat()
        item: dict[str, Any] = {
            "Tag": "",
            "MessageID": message_id or str(uuid.uuid4()),
            "MessageStream": "outbound",
            "To": [{"Email": recipient, "Name": None}],
            "Cc": [],
            "Bcc": [],
            "Recipients": [recipient],
            "ReceivedAt": received,
            "From": '"Billing" <billing@acme.example>',
            "Subject": "Invoice",
            "Attachments": [],
            "Status": "Sent",
            "TrackOpens": False,
            "TrackLinks": "None",
            "Metadata": {"smtpguard_key": tag} if tag is not None else {},
            "Sandboxed": False,
        }
        self.messages.append(Stored(item, at, self.clock() + delay))
        return item

    def add_bounce(
        self,
        at: float,
        *,
        email: str,
        kind: str = "HardBounce",
        message_id: str | None = None,
        delay: float = 0.0,
    ) -> dict[str, Any]:
        item: dict[str, Any] = {
            "ID": len(self.bounces) + 692560173,
            "Type": kind,
            "TypeCode": 1 if kind == "HardBounce" else 512,
            "Name": "Hard bounce" if kind == "HardBounce" else "Spam complaint",
            "Tag": "",
            "MessageID": message_id or str(uuid.uuid4()),
            "ServerID": 23,
            "MessageStream": "outbound",
            "Description": "The server was unable to deliver your message.",
            "Details": "action: failed\r\n",
            "Email": email,
            "From": "billing@acme.example",
            "BouncedAt": datetime.fromtimestamp(at, EASTERN).isoformat(),
            "DumpAvailable": False,
            "Inactive": kind == "HardBounce",
            "CanActivate": True,
            "Subject": "Invoice",
        }
        self.bounces.append(Stored(item, at, self.clock() + delay))
        return item

    def authorised(self, request: web.Request) -> bool:
        return request.headers.get("X-Postmark-Server-Token") == self.key

    def unauthorised(self) -> web.Response:
        return web.json_response(
            {
                "ErrorCode": 10,
                "Message": "The Server Token you provided in the X-Postmark-Server-Token request header "
                "was invalid.",
            },
            status=401,
        )

    def error(self, status: int, message: str) -> web.Response:
        return web.json_response({"ErrorCode": 1, "Message": message}, status=status)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/messages/outbound", self._outbound)
        app.router.add_get("/bounces", self._bounces)

    def _window(self, request: web.Request) -> tuple[int, int, float | None, float | None]:
        count, offset = _int(request, "count"), _int(request, "offset")
        if count is None or offset is None:
            raise ValueError("count and offset are required")
        if not 1 <= count <= 500:
            raise ValueError("count must be at most 500")
        if offset + count > 10_000:
            raise ValueError("offset + count must be at most 10000")
        fromdate = _postmark_date(request.query["fromdate"]) if "fromdate" in request.query else None
        todate = _postmark_date(request.query["todate"]) if "todate" in request.query else None
        return count, offset, fromdate, todate

    def _listed(self, rows: list[Stored], key: str, count: int, offset: int) -> web.Response:
        rows = sorted(rows, key=lambda s: s.at, reverse=True)
        return web.json_response(
            {"TotalCount": len(rows), key: [s.item for s in rows[offset : offset + count]]}
        )

    async def _outbound(self, request: web.Request) -> web.Response:
        try:
            count, offset, low, high = self._window(request)
        except ValueError as e:
            return self.error(422, str(e))
        metadata = {
            k.removeprefix("metadata_"): v for k, v in request.query.items() if k.startswith("metadata_")
        }
        recipient = request.query.get("recipient")
        rows = [
            s
            for s in self.visible(self.messages)
            if (low is None or s.at >= low)
            and (high is None or s.at <= high)
            and all(s.item["Metadata"].get(k) == v for k, v in metadata.items())
            and (recipient is None or recipient in s.item["Recipients"])
        ]
        return self._listed(rows, "Messages", count, offset)

    async def _bounces(self, request: web.Request) -> web.Response:
        try:
            count, offset, low, high = self._window(request)
        except ValueError as e:
            return self.error(422, str(e))
        rows = [
            s
            for s in self.visible(self.bounces)
            if (low is None or s.at >= low) and (high is None or s.at <= high)
        ]
        return self._listed(rows, "Bounces", count, offset)


# --- SendGrid ------------------------------------------------------------------------------
_TERM = re.compile(
    r"""\s*(?:
        unique_args\['(?P<arg>[^']+)'\]\s*=\s*"(?P<argv>(?:[^"\\]|\\.)*)"
      | msg_id\s*=\s*"(?P<msg>[^"]*)"
      | last_event_time\s+BETWEEN\s+TIMESTAMP\s+"(?P<lo>[^"]+)"\s+AND\s+TIMESTAMP\s+"(?P<hi>[^"]+)"
    )\s*""",
    re.VERBOSE,
)


def _terms(query: str) -> list[re.Match[str]] | None:
    """The query's terms joined by AND, or None when any part is not one of _TERM's."""
    out: list[re.Match[str]] = []
    pos = 0
    while True:
        m = _TERM.match(query, pos)
        if m is None:
            return None
        out.append(m)
        pos = m.end()
        if pos == len(query):
            return out
        sep = re.compile(r"AND\s+").match(query, pos)
        if sep is None:
            return None
        pos = sep.end()


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeSendgrid(FakeApi):
    def __init__(self, key: str, clock: Callable[[], float] = time.time) -> None:
        super().__init__(key, clock)
        self.messages: list[Stored] = []
        self.suppressions: dict[str, list[Stored]] = {"bounces": [], "spam_reports": [], "unsubscribes": []}

    def add_message(
        self,
        at: float,
        *,
        tag: str | None = None,
        dropped: str | None = None,
        delivered_after: float | None = None,
        delay: float = 0.0,
        details_delay: float = 0.0,
    ) -> dict[str, Any]:
        """A message processed at `at`; `dropped`: dropped with that reason; `delivered_after`:
        delivered that many seconds later (its last_event_time); `details_delay`: its details
        answer 404 for that long after it is listed."""
        msg_id = f"{uuid.uuid4().hex[:22]}.filter0001p3las1-1234-5A023E36-1.0"
        events = [{"event_name": "processed", "processed": _iso(at)}]
        last, status = at, "processed"
        if dropped is not None:
            events.append({"event_name": "dropped", "processed": _iso(at), "reason": dropped})
            status = "not_delivered"
        elif delivered_after is not None:
            last, status = at + delivered_after, "delivered"
            events.append({"event_name": "delivered", "processed": _iso(last), "mx_server": "mx.example.com"})
        summary = {
            "from_email": "billing@acme.example",
            "msg_id": msg_id,
            "subject": "Invoice",
            "to_email": "rcpt@example.com",
            "status": status,
            "opens_count": 0,
            "clicks_count": 0,
            "last_event_time": _iso(last),
        }
        detail = {
            "from_email": "billing@acme.example",
            "msg_id": msg_id,
            "subject": "Invoice",
            "to_email": "rcpt@example.com",
            "status": status,
            "template_id": "",
            "asm_group_id": 0,
            "teammate": "",
            "api_key_id": "ApiKeyId",
            "events": events,
            "originating_ip": "127.0.0.1",
            "categories": [],
            "unique_args": {"smtpguard_key": tag} if tag is not None else {},
            "outbound_ip": "127.0.0.2",
            "outbound_ip_type": "shared",
        }
        listed = self.clock() + delay
        self.messages.append(
            Stored(summary, last, listed, {"detail": detail, "details_at": listed + details_delay})
        )
        return detail

    def add_suppression(
        self, name: str, *, email: str, created: int, reason: str = "", status: str = ""
    ) -> None:
        item: dict[str, Any] = {"created": created, "email": email}
        if name == "bounces":
            item.update(reason=reason, status=status)
        elif name == "spam_reports":
            item["ip"] = "10.63.202.100"
        self.suppressions[name].append(Stored(item, float(created), self.clock()))

    def authorised(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.key}"

    def unauthorised(self) -> web.Response:
        return web.json_response(
            {"errors": [{"field": None, "message": "authorization required"}]}, status=401
        )

    def error(self, status: int, message: str) -> web.Response:
        return web.json_response({"errors": [{"field": None, "message": message}]}, status=status)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v3/messages", self._messages)
        app.router.add_get("/v3/messages/{msg_id}", self._message)
        app.router.add_get("/v3/suppression/{name}", self._suppression)

    async def _messages(self, request: web.Request) -> web.Response:
        query = request.query.get("query")
        try:
            limit = _int(request, "limit", 10)
        except ValueError as e:
            return self.error(400, str(e))
        if not query:
            return self.error(400, "query is required")
        if limit is None or not 1 <= limit <= 1000:
            return self.error(400, "limit must be greater than 0 and less than or equal to 1000")
        tests: list[Callable[[Stored], bool]] = []
        terms = _terms(query)
        if terms is None:
            return self.error(400, f"invalid query: {query!r}")
        for m in terms:
            if m["arg"] is not None:
                name, value = m["arg"], m["argv"].replace('\\"', '"').replace("\\\\", "\\")
                tests.append(lambda s, n=name, v=value: s.meta["detail"]["unique_args"].get(n) == v)
            elif m["msg"] is not None:
                tests.append(lambda s, v=m["msg"]: s.item["msg_id"] == v)
            else:
                lo, hi = (
                    datetime.fromisoformat(x.replace("Z", "+00:00")).timestamp() for x in (m["lo"], m["hi"])
                )
                tests.append(lambda s, a=lo, b=hi: a <= s.at <= b)
        rows = [s for s in self.visible(self.messages) if all(t(s) for t in tests)]
        rows.sort(key=lambda s: s.at, reverse=True)
        return web.json_response({"messages": [s.item for s in rows[:limit]]})

    async def _message(self, request: web.Request) -> web.Response:
        for s in self.visible(self.messages):
            if s.item["msg_id"] == request.match_info["msg_id"] and s.meta["details_at"] <= self.clock():
                return web.json_response(s.meta["detail"])
        return self.error(404, "Not Found")

    async def _suppression(self, request: web.Request) -> web.Response:
        rows = self.suppressions.get(request.match_info["name"])
        if rows is None:
            return self.error(404, "Not Found")
        try:
            start, end = _int(request, "start_time"), _int(request, "end_time")
            limit, offset = _int(request, "limit", 500), _int(request, "offset", 0)
        except ValueError as e:
            return self.error(400, str(e))
        assert limit is not None and offset is not None
        if not 1 <= limit <= 500:
            return self.error(400, "limit must be at most 500")
        picked = [
            s for s in self.visible(rows) if (start is None or s.at >= start) and (end is None or s.at <= end)
        ]
        picked.sort(key=lambda s: s.at, reverse=True)
        return web.json_response([s.item for s in picked[offset : offset + limit]])
