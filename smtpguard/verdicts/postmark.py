"""Postmark's Messages and Bounces APIs, header `X-Postmark-Server-Token`.

Documented at https://postmarkapp.com/developer/api/messages-api (outbound message search:
GET /messages/outbound with `count` (at most 500) and `offset` required, `recipient`,
`fromdate`/`todate`, `metadata_NAME=VALUE`; answer `{"TotalCount": n, "Messages": [...]}`,
newest first, each with `MessageID`, `Status`, `ReceivedAt`, `Metadata`) and
https://postmarkapp.com/developer/api/bounce-api (GET /bounces with `count`, `offset`,
`fromdate`, `todate`; answer `{"TotalCount": n, "Bounces": [...]}` with `ID`, `Type`,
`MessageID`, `Email`, `BouncedAt`).

Every message in the outbound search was taken by Postmark: the search lists no refusals.
It does not show the Message-ID header either, so a record is found by smtpguard's tag
(`metadata_smtpguard_key`, from X-PM-Metadata-smtpguard_key); the upstream id is Postmark's
`MessageID`, the one its 250 names. Postmark reads `fromdate`/`todate` in its own time zone
(US Eastern), so the date filter is widened by a day each side and the window is applied to
`ReceivedAt`, which carries its offset.
"""

from __future__ import annotations

from typing import Any

from smtpguard.policy.events import KEY_FIELD, Match, ProviderEvent, strs
from smtpguard.policy.verdicts import Attempt, LogEntry, LogKind, window
from smtpguard.verdicts.http import ApiClient, ApiError, field
from smtpguard.verdicts.model import Reported, api_source, iso_utc, parse_time

PAGE = 500
MAX_PAGES = 10
DAY = 86400.0
METADATA_MAX = 80
"""The longest metadata value Postmark keeps (its custom-metadata FAQ). A longer tag may be
cut or dropped on the way in, and a search by the whole tag then finds nothing: absence,
which with a later acceptance reads as `not accepted`, and a second copy."""
_BOUNCES = {"HardBounce": Reported.BOUNCE, "SpamComplaint": Reported.COMPLAINT}


def _day(t: float) -> str:
    return iso_utc(t)[:19]  # Postmark's examples: 2014-02-01T10:00:00, no zone


class PostmarkLog(ApiClient):
    kind = "postmark"

    def credential_header(self, key: str) -> tuple[str, str]:
        return "X-Postmark-Server-Token", key

    async def _list(
        self, path: str, key: str, params: dict[str, str], max_pages: int = MAX_PAGES
    ) -> list[Any]:
        out: list[Any] = []
        base = {**params, "count": str(PAGE)}

        def following(body: Any, n: int) -> tuple[str, dict[str, str]] | None:
            total = field(body, "TotalCount")
            offset = n * PAGE
            # Postmark serves at most 10,000 of a search (offset + count).
            if not isinstance(total, int) or offset >= total or offset + PAGE > 10_000:
                return None
            return path, {**base, "offset": str(offset)}

        async for body in self.pages((path, {**base, "offset": "0"}), following, max_pages):
            out.extend(self.need_list(body, key))
        return out

    async def entries(self, attempt: Attempt) -> list[LogEntry]:
        # The search finds a message by its tag alone (not by its Message-ID): without one
        # that Postmark keeps whole, finding nothing proves nothing, so no verdict is given
        # (none yet, then gave up: the record waits for an operator).
        if attempt.tag is None or len(attempt.tag) > METADATA_MAX:
            raise ApiError(
                f"{self.provider}: Postmark's log cannot be searched for this record: "
                + ("it has no tag" if attempt.tag is None else f"its tag is over {METADATA_MAX} characters")
            )
        first, last = window(attempt)
        params = {
            f"metadata_{KEY_FIELD}": attempt.tag,
            "fromdate": _day(first - DAY),
            "todate": _day(last + DAY),
        }
        items = await self._list("/messages/outbound", "Messages", params)
        return [e for e in (self._entry(item, strict=True) for item in items) if e is not None]

    async def accepted_since(self, at: float) -> list[LogEntry]:
        body = await self.get_json(
            "/messages/outbound", {"count": "5", "offset": "0", "fromdate": _day(at - DAY)}
        )
        entries = (self._entry(m) for m in self.need_list(body, "Messages"))
        return [e for e in entries if e is not None and e.at > at]

    async def reported_since(self, since: float, until: float) -> list[ProviderEvent]:
        params = {"fromdate": _day(since - DAY), "todate": _day(until + DAY)}
        items = await self._list("/bounces", "Bounces", params)
        out = [r for r in map(self._reported, items) if r is not None]
        return [r for r in out if since <= r.at < until]

    def _entry(self, item: Any, strict: bool = False) -> LogEntry | None:
        at = parse_time(field(item, "ReceivedAt"))
        mid = field(item, "MessageID")
        if at is None and strict:
            raise self.untimed()
        if at is None or not isinstance(mid, str):
            return None
        tag = field(item, "Metadata", KEY_FIELD)
        return LogEntry(
            provider=self.provider,
            kind=LogKind.ACCEPTED,
            at=at,
            tag=tag if isinstance(tag, str) else None,
            upstream_id=mid,
        )

    def _reported(self, item: Any) -> ProviderEvent | None:
        btype = field(item, "Type")
        kind = _BOUNCES.get(btype) if isinstance(btype, str) else None
        email, at, ident = field(item, "Email"), parse_time(field(item, "BouncedAt")), field(item, "ID")
        if kind is None or not isinstance(email, str) or at is None or ident is None:
            return None
        mid = field(item, "MessageID")
        # Named and spelt as Postmark's bounce webhook names the same bounce (its RecordType,
        # Type and ID; events/sources/postmark.py), so that the one arriving second is a
        # duplicate of the first, whichever way each came.
        record_type = "SpamComplaint" if kind is Reported.COMPLAINT else "Bounce"
        return ProviderEvent(
            source=api_source(self.provider),
            kind=kind,
            provider_type=record_type if record_type == "SpamComplaint" else f"Bounce/{btype}",
            recipient=email,
            status=str(btype) if record_type == "Bounce" else "",
            at=at,
            event_id=f"{record_type}:{ident}",
            match=Match(upstream_ids=strs(mid)),
        )
