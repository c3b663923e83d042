"""The log-API clients against the local fakes (tests/support/provider_api_fakes.py): the §19 verdicts
they lead to, paging, 429 honoured, 5xx retried within a bound, 401 logged once an hour, and
the API key in no log line, exception or repr. Every count is of requests the fake received."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import yaml

from smtpguard.config import ConfigError, loads
from smtpguard.policy.verdicts import Attempt, LogKind, VerdictKind, ingested_past, log_identity
from smtpguard.verdicts import api_key, client_for
from smtpguard.verdicts.http import (
    ApiAuthRefused,
    ApiClient,
    ApiError,
    ApiMalformed,
    ApiUnavailable,
    Retry,
    retry_after,
)
from smtpguard.verdicts.mailgun import MailgunLog
from smtpguard.verdicts.model import LogApi, Reported
from smtpguard.verdicts.postmark import PostmarkLog
from smtpguard.verdicts.sendgrid import SendgridLog
from tests.support import FakeClock, base_config
from tests.support.provider_api_fakes import FakeMailgun, FakePostmark, FakeSendgrid
from tests.support.verdicts import ABSENT_AFTER as ABSENT
from tests.support.verdicts import judged
from tests.verdicts.conftest import KEY, Now

FAST = Retry(attempts=4, backoff=0.02, backoff_max=0.1, retry_after_max=5.0)


def mg_client(fake: FakeMailgun, now: Now, key: str = KEY, **kw: Any) -> MailgunLog:
    return MailgunLog(
        provider="primary", base_url=fake.base_url, key=key, domain=fake.domain, wall=now, retry=FAST, **kw
    )


def pm_client(fake: FakePostmark, now: Now, key: str = KEY, **kw: Any) -> PostmarkLog:
    return PostmarkLog(provider="primary", base_url=fake.base_url, key=key, wall=now, retry=FAST, **kw)


def sg_client(fake: FakeSendgrid, now: Now, key: str = KEY, **kw: Any) -> SendgridLog:
    return SendgridLog(provider="primary", base_url=fake.base_url, key=key, wall=now, retry=FAST, **kw)


async def judge(client: LogApi, attempt: Attempt, now: float) -> Any:
    """What the verdict loop will do at one look: ask, then apply the §19 table."""
    entries = await client.entries(attempt)
    proof = ingested_past(attempt, await client.accepted_since(attempt.at))
    return judged(attempt, entries, now=now, proof=proof, log=client.log)


# --- the table, through each API ------------------------------------------------------------
async def test_mailgun_accepted_refused_not_accepted_and_none_yet(mailgun: FakeMailgun, now: Now) -> None:
    t = now.t
    mailgun.add("accepted", t + 1, message_id="<a@acme.example>", tag="acme:1")
    mailgun.add("rejected", t + 2, message_id="<b@acme.example>", tag="acme:2", reason="Sandbox domain")
    async with mg_client(mailgun, now) as client:
        v = await judge(client, Attempt("primary", t, "acme:1", "<a@acme.example>"), t + 120)
        assert (v.kind, v.upstream_id) == (VerdictKind.ACCEPTED, "a@acme.example")
        v = await judge(client, Attempt("primary", t, "acme:2", "<b@acme.example>"), t + 120)
        assert (v.kind, v.reason) == (VerdictKind.REFUSED, "Sandbox domain")
        lost = Attempt("primary", t + 10, "acme:3", "<c@acme.example>", log=client.log)
        assert (await judge(client, lost, t + 120)).kind is VerdictKind.NONE_YET  # too early
        assert (await judge(client, lost, t + 10 + ABSENT)).kind is VerdictKind.NONE_YET  # nothing later
        mailgun.add("accepted", t + 300, message_id="<d@acme.example>", tag="acme:4")
        assert (await judge(client, lost, t + 10 + ABSENT)).kind is VerdictKind.NOT_ACCEPTED
        # Sent while the provider's api named another log (another domain or key): absent
        # from this one proves nothing.
        for other in (None, log_identity("mailgun", client.base_url, "mg2.acme.example", KEY)):
            moved = replace(lost, log=other)
            assert (await judge(client, moved, t + 10 + ABSENT)).kind is VerdictKind.NONE_YET
    sent = [r.query for r in mailgun.requests if r.path.endswith("/events")]
    assert sent[0]["message-id"] == "a@acme.example" and sent[0]["event"] == "accepted OR rejected"
    assert float(sent[0]["end"]) - float(sent[0]["begin"]) == pytest.approx(1200, abs=1)


async def test_postmark_accepted_by_tag_and_not_accepted_with_the_proof(
    postmark: FakePostmark, now: Now
) -> None:
    t = now.t
    sent = postmark.add_message(t + 3, tag="acme:1")
    async with pm_client(postmark, now) as client:
        v = await judge(client, Attempt("primary", t, "acme:1", "<a@acme.example>"), t + 120)
        assert (v.kind, v.upstream_id) == (VerdictKind.ACCEPTED, sent["MessageID"])
        lost = Attempt("primary", t + 10, "acme:2", "<b@acme.example>", tagged="postmark", log=client.log)
        assert (await judge(client, lost, t + ABSENT)).kind is VerdictKind.NONE_YET
        postmark.add_message(t + 400, tag="acme:3")
        assert (await judge(client, lost, t + 10 + ABSENT)).kind is VerdictKind.NOT_ACCEPTED
        # Not known to have carried the Postmark tag (sent before `api:` was configured, or
        # noted by an earlier release): its absence from a search by that tag proves nothing.
        for tagged in (None, "sendgrid", "mailgun"):
            untagged = replace(lost, tagged=tagged)
            assert (await judge(client, untagged, t + 10 + ABSENT)).kind is VerdictKind.NONE_YET
        # No tag, or one longer than Postmark keeps of a metadata value: the search cannot
        # find the message, so nothing is asked and no absence is proved, although another
        # message was accepted later (acme:3) and absent_after has passed.
        before = len(postmark.requests)
        long_tag = "acme:" + "x" * 76
        for tag in (None, long_tag):
            with pytest.raises(ApiError, match="cannot be searched"):
                await client.entries(Attempt("primary", t + 10, tag, "<b@acme.example>"))
        assert len(postmark.requests) == before
        assert (
            await judge(
                client,
                Attempt("primary", t + 10, long_tag[:80], None, tagged="postmark", log=client.log),
                t + 10 + ABSENT,
            )
        ).kind is (VerdictKind.NOT_ACCEPTED)  # 80 characters are searched as before
    q = postmark.requests[0].query
    assert q["metadata_smtpguard_key"] == "acme:1" and q["count"] == "500" and q["offset"] == "0"


async def test_sendgrid_accepted_dropped_and_a_late_delivery_keeps_the_send_time(
    sendgrid: FakeSendgrid, now: Now
) -> None:
    t = now.t
    # delivered three hours after it was processed: the window is about the processed time
    ok = sendgrid.add_message(t + 2, tag="acme:1", delivered_after=3 * 3600)
    sendgrid.add_message(t + 2, tag="acme:2", dropped="Bounced Address")
    async with sg_client(sendgrid, now) as client:
        v = await judge(client, Attempt("primary", t, "acme:1", None), t + 120)
        assert (v.kind, v.upstream_id) == (VerdictKind.ACCEPTED, ok["msg_id"])
        v = await judge(client, Attempt("primary", t, "acme:2", None), t + 120)
        assert (v.kind, v.reason) == (VerdictKind.REFUSED, "Bounced Address")
        lost = Attempt("primary", t + 5, "acme:3", None, tagged="sendgrid", log=client.log)
        sendgrid.add_message(t + 200, tag="acme:4")
        now.t = t + 5 + ABSENT
        assert (await judge(client, lost, now.t)).kind is VerdictKind.NOT_ACCEPTED
        untagged = replace(lost, tagged=None)
        assert (await judge(client, untagged, now.t)).kind is VerdictKind.NONE_YET
        another_account = replace(lost, log=log_identity("sendgrid", client.base_url, None, "another-key"))
        assert (await judge(client, another_account, now.t)).kind is VerdictKind.NONE_YET
    queries = [r.query.get("query", "") for r in sendgrid.requests if r.path == "/v3/messages"]
    assert queries[0] == "unique_args['smtpguard_key']=\"acme:1\""


async def test_an_entry_logged_late_turns_none_yet_into_accepted(mailgun: FakeMailgun, now: Now) -> None:
    t = now.t
    mailgun.add("accepted", t + 1, message_id="<a@acme.example>", tag="acme:1", delay=90)
    attempt = Attempt("primary", t, "acme:1", "<a@acme.example>")
    async with mg_client(mailgun, now) as client:
        assert (await judge(client, attempt, t + 60)).kind is VerdictKind.NONE_YET
        now.t = t + 91
        assert (await judge(client, attempt, t + 120)).kind is VerdictKind.ACCEPTED


# --- paging ---------------------------------------------------------------------------------
async def test_mailgun_pages_through_next_until_the_empty_page(mailgun: FakeMailgun, now: Now) -> None:
    t = now.t
    for i in range(650):
        mailgun.add("accepted", t + i * 0.5, message_id="<bulk@acme.example>", tag=f"acme:{i}")
    async with mg_client(mailgun, now) as client:
        entries = await client.entries(Attempt("primary", t, "acme:649", "<bulk@acme.example>"))
    assert len(entries) == 650
    assert len(mailgun.requests) == 4  # 300 + 300 + 50, then the empty page
    assert [r.path.count("/") for r in mailgun.requests] == [3, 4, 4, 4]


async def test_postmark_pages_by_offset_up_to_total_count(postmark: FakePostmark, now: Now) -> None:
    t = now.t
    for i in range(1100):
        postmark.add_message(t + i * 0.1, tag="acme:1")
    async with pm_client(postmark, now) as client:
        entries = await client.entries(Attempt("primary", t, "acme:1", None))
    assert len(entries) == 1100
    assert [r.query["offset"] for r in postmark.requests] == ["0", "500", "1000"]


async def test_a_paging_link_off_the_base_url_is_not_followed(mailgun: FakeMailgun, now: Now) -> None:
    mailgun.add("accepted", now.t, message_id="<a@x>", tag="acme:1")
    # The fake writes its links with 127.0.0.1; a client configured with localhost must not
    # send its key to what is, by name, another host.
    client = MailgunLog(
        provider="primary",
        base_url=mailgun.base_url.replace("127.0.0.1", "localhost"),
        key=KEY,
        domain=mailgun.domain,
        retry=FAST,
    )
    async with client:
        with pytest.raises(ApiMalformed, match="paging link points off"):
            await client.entries(Attempt("primary", now.t, "acme:1", "<a@x>"))
    assert len(mailgun.requests) == 1
    assert client.errors["malformed"] == 1


# --- 429, 5xx, network ----------------------------------------------------------------------
async def test_429_with_retry_after_is_waited_for(sendgrid: FakeSendgrid, now: Now) -> None:
    sendgrid.fail(429, times=1, retry_after="1")
    async with sg_client(sendgrid, now) as client:
        assert await client.entries(Attempt("primary", now.t, "acme:1", None)) == []
    first, second = sendgrid.requests[0], sendgrid.requests[1]
    assert len(sendgrid.requests) == 2
    assert 0.95 <= second.at - first.at < 3.0
    assert client.errors["rate_limited"] == 1


async def test_429_without_retry_after_backs_off_exponentially_then_gives_up(
    postmark: FakePostmark, now: Now
) -> None:
    postmark.fail(429, times=10)
    async with pm_client(postmark, now) as client:
        with pytest.raises(ApiUnavailable, match="after 4 requests"):
            await client.entries(Attempt("primary", now.t, "acme:1", None))
    assert len(postmark.requests) == 4
    gaps = [b.at - a.at for a, b in zip(postmark.requests, postmark.requests[1:], strict=False)]
    assert [round(g, 2) >= w for g, w in zip(gaps, (0.02, 0.04, 0.08), strict=True)] == [True] * 3
    assert client.errors["rate_limited"] == 4 and client.errors["unavailable"] == 1


async def test_a_retry_after_beyond_the_bound_is_not_waited_for(mailgun: FakeMailgun, now: Now) -> None:
    mailgun.fail(429, times=1, retry_after="3600")
    async with mg_client(mailgun, now) as client:
        # A client that waited the hour out fails here rather than hanging the suite.
        with pytest.raises(ApiUnavailable, match="Retry-After 3600s"):
            await asyncio.wait_for(client.entries(Attempt("primary", now.t, "acme:1", "<a@x>")), 30)
    assert len(mailgun.requests) == 1


async def test_500_is_retried_within_the_bound(mailgun: FakeMailgun, now: Now) -> None:
    mailgun.add("accepted", now.t, message_id="<a@x>", tag="acme:1")
    mailgun.fail(500, times=2)
    async with mg_client(mailgun, now) as client:
        entries = await client.entries(Attempt("primary", now.t, "acme:1", "<a@x>"))
        assert [e.kind for e in entries] == [LogKind.ACCEPTED]
        assert len(mailgun.requests) == 4  # two 500s, the page, the empty page
        mailgun.fail(503, times=50)
        with pytest.raises(ApiUnavailable, match=r"after 4 requests \(HTTP 503\)"):
            await client.entries(Attempt("primary", now.t, "acme:1", "<a@x>"))
    assert len(mailgun.requests) == 8
    assert client.errors["server"] == 6


async def test_an_api_that_is_down_is_unavailable_within_the_bound(now: Now) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    client = SendgridLog(
        provider="primary", base_url=f"http://127.0.0.1:{port}", key=KEY, wall=now, retry=FAST
    )
    async with client:
        with pytest.raises(ApiUnavailable, match="after 4 requests"):
            await asyncio.wait_for(client.entries(Attempt("primary", now.t, "acme:1", None)), 30)
    assert client.errors["network"] == 4 and client.requests == 4


# --- 401 and the key ------------------------------------------------------------------------
async def test_401_is_logged_once_an_hour_and_counted_every_time(
    postmark: FakePostmark, now: Now, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    mono = FakeClock()
    async with pm_client(postmark, now, key="wrong-token", clock=mono) as client:
        for _ in range(3):
            with pytest.raises(ApiAuthRefused):
                await client.entries(Attempt("primary", now.t, "acme:1", None))
        mono.t += 3599
        with pytest.raises(ApiAuthRefused):
            await client.accepted_since(now.t)
        mono.t += 1
        with pytest.raises(ApiAuthRefused):
            await client.reported_since(now.t - 60, now.t)
    logged = [r for r in caplog.records if "refused smtpguard's credentials" in r.getMessage()]
    assert len(logged) == 2
    assert [(r.provider, r.status) for r in logged] == [("primary", 401)] * 2  # type: ignore[attr-defined]
    assert client.errors["auth"] == 5
    assert len(postmark.requests) == 5  # a refused credential is not retried


def _leaks(text: str) -> bool:
    basic = base64.b64encode(f"api:{KEY}".encode()).decode()
    return KEY in text or basic in text or KEY[4:20] in text


async def test_the_key_is_in_no_log_exception_or_repr(
    mailgun: FakeMailgun,
    postmark: FakePostmark,
    sendgrid: FakeSendgrid,
    now: Now,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    mailgun.fail(500, times=4)
    postmark.fail(429, times=4)
    sendgrid.fail(403, times=1)
    clients: list[MailgunLog | PostmarkLog | SendgridLog] = [
        mg_client(mailgun, now),
        pm_client(postmark, now),
        sg_client(sendgrid, now),
        mg_client(mailgun, now, key=KEY[::-1]),  # a wrong key: 401
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    clients.append(SendgridLog(provider="down", base_url=f"http://127.0.0.1:{closed}", key=KEY, retry=FAST))
    for client in clients:
        texts += [repr(client), str(client), str(client.__dict__)]
        async with client:
            for call in (
                lambda c=client: c.entries(Attempt("primary", now.t, "acme:1", "<a@x>")),
                lambda c=client: c.reported_since(now.t - 60, now.t),
            ):
                try:
                    await call()
                except Exception as e:  # every failure's text is checked, whatever its type
                    texts += [str(e), repr(e), repr(e.__cause__), repr(e.__context__)]
    for record in caplog.records:
        texts += [record.getMessage(), str(record.__dict__)]
    assert len(caplog.records) >= 2  # the 403 and the 401 were logged
    assert not [t for t in texts if _leaks(t)]
    assert sum(len(f.requests) for f in (mailgun, postmark, sendgrid)) >= 10


# --- reconciliation reads -------------------------------------------------------------------
async def test_each_api_reports_bounces_complaints_and_unsubscribes(
    mailgun: FakeMailgun, postmark: FakePostmark, sendgrid: FakeSendgrid, now: Now
) -> None:
    t = now.t
    mailgun.add("failed", t + 1, message_id="<a@x>", recipient="gone@example.com", reason="no such user")
    mailgun.add("failed", t + 2, message_id="<b@x>", recipient="full@example.com", severity="temporary")
    mailgun.add("complained", t + 3, message_id="<c@x>", recipient="angry@example.com")
    mailgun.add("unsubscribed", t + 4, message_id="<d@x>", recipient="bye@example.com")
    postmark.add_bounce(t + 1, email="gone@example.com")
    postmark.add_bounce(t + 2, email="angry@example.com", kind="SpamComplaint")
    postmark.add_bounce(t - 7200, email="old@example.com")
    sendgrid.add_suppression("bounces", email="gone@example.com", created=int(t + 1), status="5.1.1")
    sendgrid.add_suppression("spam_reports", email="angry@example.com", created=int(t + 2))
    sendgrid.add_suppression("unsubscribes", email="bye@example.com", created=int(t + 3))
    got: dict[str, list[tuple[Reported, str | None]]] = {}
    for name, client in (
        ("mailgun", mg_client(mailgun, now)),
        ("postmark", pm_client(postmark, now)),
        ("sendgrid", sg_client(sendgrid, now)),
    ):
        async with client:
            first = await client.reported_since(t - 60, t + 60)
            again = await client.reported_since(t - 60, t + 60)
        assert [r.event_id for r in first] == [r.event_id for r in again]  # the same event has one id
        got[name] = sorted((r.kind, r.recipient) for r in first)
    assert got["mailgun"] == [
        (Reported.BOUNCE, "gone@example.com"),
        (Reported.COMPLAINT, "angry@example.com"),
        (Reported.UNSUBSCRIBE, "bye@example.com"),
    ]
    assert got["postmark"] == [
        (Reported.BOUNCE, "gone@example.com"),
        (Reported.COMPLAINT, "angry@example.com"),
    ]
    assert got["sendgrid"] == got["mailgun"]


# --- from config ----------------------------------------------------------------------------
async def test_clients_are_built_from_config_with_the_key_from_env_or_file(
    tmp_path: Any,
    mailgun: FakeMailgun,
    postmark: FakePostmark,
    sendgrid: FakeSendgrid,
    now: Now,
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    monkeypatch.setenv("MAILGUN_API_KEY", KEY)
    (tmp_path / "pm.token").write_text(KEY + "\n")
    monkeypatch.setenv("SENDGRID_API_KEY", KEY)
    cfg = base_config(tmp_path, 2525)
    first = cfg["providers"][0]
    cfg["providers"] = [
        dict(
            first,
            name="mg",
            api={
                "kind": "mailgun",
                "key_env": "MAILGUN_API_KEY",
                "domain": mailgun.domain,
                "base_url": mailgun.base_url,
            },
        ),
        dict(
            first,
            name="pm",
            api={"kind": "postmark", "token_file": str(tmp_path / "pm.token"), "base_url": postmark.base_url},
        ),
        dict(
            first,
            name="sg",
            api={
                "kind": "sendgrid",
                "key_env": "SENDGRID_API_KEY",
                "base_url": sendgrid.base_url,
                "max_connections": 2,
                "timeout": "3s",
            },
        ),
    ]
    config = loads(yaml.safe_dump(cfg))
    kinds = []
    for i, p in enumerate(config.providers):
        api = p.api  # type: ignore[union-attr]
        assert api is not None
        client = client_for(p.name, api, api_key(api, f"providers[{i}].api"), wall=now)
        kinds.append(type(client).__name__)
        assert isinstance(client, ApiClient) and client.kind == api.kind
        assert not _leaks(repr(client) + str(client.__dict__))
        async with client:
            assert await client.accepted_since(now.t) == []
    assert kinds == ["MailgunLog", "PostmarkLog", "SendgridLog"]
    mg_api = config.providers[0].api  # type: ignore[union-attr]
    assert mg_api is not None
    # A Mailgun key must not go to SendGrid's API (its default base_url) nor the other way.
    with pytest.raises(ValueError, match="SendgridLog reads a sendgrid log, not mailgun"):
        SendgridLog.from_config("mg", mg_api, KEY)
    assert all(r.authorised for f in (mailgun, postmark, sendgrid) for r in f.requests)
    assert [len(f.requests) for f in (mailgun, postmark, sendgrid)] == [1, 1, 1]
    monkeypatch.delenv("SENDGRID_API_KEY")
    sg_api = config.providers[2].api  # type: ignore[union-attr]
    assert sg_api is not None
    with pytest.raises(
        ConfigError, match=r"providers\[2\]\.api: environment variable SENDGRID_API_KEY is not set"
    ):
        api_key(sg_api, "providers[2].api")


# --- timeout and connection limit -----------------------------------------------------------
def test_a_client_takes_a_key_or_an_auth_not_both_nor_neither() -> None:
    url = "https://api.sendgrid.com"
    with pytest.raises(TypeError, match="takes a key or an auth"):
        SendgridLog(provider="sg", base_url=url)
    with pytest.raises(TypeError, match="takes a key or an auth"):
        SendgridLog(provider="sg", base_url=url, key=KEY, auth=dict)
    with pytest.raises(TypeError):
        ApiClient(provider="any", base_url=url, key=KEY)  # no header named for a key


async def test_a_hung_api_times_out_within_the_bound(mailgun: FakeMailgun, now: Now) -> None:
    mailgun.stall = 5.0
    async with mg_client(mailgun, now, timeout=0.2) as client:
        # Each of the four requests ended by the client's 0.2 s timeout (TimeoutError), none
        # by the fake's answer after its 5 s stall, which would have been a success.
        with pytest.raises(ApiUnavailable, match=r"after 4 requests \(TimeoutError\)"):
            await asyncio.wait_for(client.entries(Attempt("primary", now.t, "acme:1", "<a@x>")), 30)
    assert len(mailgun.requests) == 4
    assert client.errors["network"] == 4


async def test_one_client_keeps_at_most_max_connections_open(postmark: FakePostmark, now: Now) -> None:
    postmark.stall = 0.2
    async with pm_client(postmark, now, max_connections=2) as client:
        await asyncio.gather(*(client.accepted_since(now.t) for _ in range(6)))
    assert len(postmark.requests) == 6
    assert postmark.most_in_flight == 2


async def test_sendgrid_details_not_yet_there_are_none_yet_not_an_error(
    sendgrid: FakeSendgrid, now: Now
) -> None:
    t = now.t
    sendgrid.add_message(t + 1, tag="acme:1", details_delay=60)
    attempt = Attempt("primary", t, "acme:1", None)
    async with sg_client(sendgrid, now) as client:
        assert (await judge(client, attempt, t + 120)).kind is VerdictKind.NONE_YET
        now.t += 60
        assert (await judge(client, attempt, t + 120)).kind is VerdictKind.ACCEPTED
    assert client.errors["unavailable"] == 0


async def test_another_refusal_is_not_retried(mailgun: FakeMailgun, now: Now) -> None:
    client = MailgunLog(
        provider="primary", base_url=mailgun.base_url, key=KEY, domain="other.example", retry=FAST
    )
    async with client:
        with pytest.raises(ApiError, match="answered HTTP 404"):
            await client.entries(Attempt("primary", now.t, "acme:1", "<a@x>"))
    assert len(mailgun.requests) == 1


def test_retry_after_reads_seconds_and_http_dates() -> None:
    t = 1_700_000_000.0
    assert retry_after("7", t) == 7.0
    assert retry_after(" 0 ", t) == 0.0
    assert retry_after("Tue, 14 Nov 2023 22:13:50 GMT", t) == pytest.approx(30.0)
    assert retry_after("Tue, 14 Nov 2023 22:13:00 GMT", t) == 0.0  # already past
    for bad in (None, "", "soon", "-5", "1.5"):
        assert retry_after(bad, t) is None


@pytest.fixture
async def hostile_api() -> AsyncIterator[tuple[str, dict[str, int]]]:
    """An API that answers 200 with what no provider documents: a body of 24 MiB streamed a
    MiB at a time (`/big`), or JSON nested deeper than a parser recurses (`/deep`). The
    count is of bytes it managed to write."""
    from aiohttp import web

    sent = {"big": 0}

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"items": ["')
        chunk = b"x" * (1 << 20)
        with contextlib.suppress(ConnectionError):
            for _ in range(24):
                await resp.write(chunk)
                sent["big"] += len(chunk)
            await resp.write(b'"], "paging": {}}')
        return resp

    async def deep(request: web.Request) -> web.Response:
        return web.Response(body=b'{"items": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")

    app = web.Application()
    app.router.add_get("/big/v3/mg.acme.example/events", big)
    app.router.add_get("/deep/v3/mg.acme.example/events", deep)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", sent
    await runner.cleanup()


async def test_a_200_too_big_or_too_deep_to_read_is_malformed_not_a_crash(
    hostile_api: tuple[str, dict[str, int]], now: Now
) -> None:
    base, sent = hostile_api
    attempt = Attempt("primary", now.t, "acme:1", "<a@x>")
    for path in ("big", "deep"):
        url = f"{base}/{path}"
        client = MailgunLog(provider="primary", base_url=url, key=KEY, domain="mg.acme.example", retry=FAST)
        async with client:
            with pytest.raises(ApiMalformed, match="answered 200 with"):
                await client.entries(attempt)
    assert sent["big"] < 24 << 20, "the whole body was read"


async def test_an_entry_of_the_message_whose_time_cannot_be_read_is_no_absence(
    mailgun: FakeMailgun, postmark: FakePostmark, now: Now
) -> None:
    """The log holds the message's acceptance but spells its time in no way smtpguard reads
    (an API change, a bug): dropping the entry would leave only the other message's later
    acceptance, the proof, and `not accepted` would send the second copy."""
    t = now.t
    lost = Attempt("primary", t, "acme:1", "<a@acme.example>")
    item = mailgun.add("accepted", t + 1, message_id="<a@acme.example>", tag="acme:1")
    item["timestamp"] = "Tue, 01 Dec 2026 10:00:00 GMT"
    mailgun.add("accepted", t + 300, message_id="<d@acme.example>", tag="acme:4")
    async with mg_client(mailgun, now) as client:
        with pytest.raises(ApiMalformed, match="time"):
            await judge(client, lost, t + ABSENT + 60)
    pm = postmark.add_message(t + 1, tag="acme:1")
    pm["ReceivedAt"] = "yesterday"
    postmark.add_message(t + 300, tag="acme:4")
    async with pm_client(postmark, now) as client:
        with pytest.raises(ApiMalformed, match="time"):
            await judge(client, lost, t + ABSENT + 60)
