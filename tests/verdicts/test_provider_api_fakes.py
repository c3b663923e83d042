"""The provider API fakes are checked against the providers' documentation before any client
test trusts them: what each fake answers has the shape of the documentation's example
(tests/support/fixtures/provider_api/*.json, each naming its page), each fake refuses what the
provider refuses, and the clients read the documentation's own examples as expected."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from smtpguard.policy.verdicts import LogKind
from smtpguard.verdicts.mailgun import MailgunLog
from smtpguard.verdicts.model import Reported
from smtpguard.verdicts.postmark import PostmarkLog
from smtpguard.verdicts.sendgrid import SendgridLog
from tests.support import FakeClock
from tests.support.provider_api_fakes import FakeApi, FakeMailgun, FakePostmark, FakeSendgrid
from tests.verdicts.conftest import KEY

FIXTURES = Path(__file__).parents[1] / "support" / "fixtures" / "provider_api"
T = 1_700_000_000.0


def example(name: str) -> Any:
    doc = json.loads((FIXTURES / name).read_text())
    assert doc["_doc"].startswith("https://")
    return doc["example"]


FREE_FORM = {"Metadata", "unique_args", "user-variables"}
"""The sender's own custom data: its keys are the example's, not the API's."""
PER_EVENT = {"events": {"event_name", "processed"}}
"""SendGrid's message events carry fields by event name; all carry these."""


def same_shape(doc: Any, ours: Any, where: str = "$") -> list[str]:
    """Where `ours` lacks a key of the documented example or holds another JSON type."""
    problems: list[str] = []
    name = where.rsplit(".", 1)[-1].split("[")[0]
    if name in FREE_FORM:
        return [] if isinstance(ours, dict) else [f"{where}: {type(ours).__name__}, documented object"]
    if where.endswith(".events[0]") and isinstance(doc, dict):
        doc = {k: v for k, v in doc.items() if k in PER_EVENT["events"]}
    if doc is None:
        return problems  # a documented null says nothing about the type
    if isinstance(doc, bool) or isinstance(ours, bool):
        return [] if type(doc) is type(ours) else [f"{where}: {type(ours).__name__}, documented bool"]
    if isinstance(doc, int | float) and isinstance(ours, int | float):
        return problems
    if type(doc) is not type(ours):
        return [f"{where}: {type(ours).__name__}, documented {type(doc).__name__}"]
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k not in ours:
                problems.append(f"{where}.{k}: missing")
            else:
                problems += same_shape(v, ours[k], f"{where}.{k}")
    if isinstance(doc, list) and doc and ours:
        problems += same_shape(doc[0], ours[0], f"{where}[0]")
    return problems


async def get(fake: FakeApi, path: str, headers: dict[str, str], params: dict[str, str] | None = None) -> Any:
    async with (
        aiohttp.ClientSession() as s,
        s.get(fake.base_url + path, headers=headers, params=params or {}) as r,
    ):
        return r.status, await r.json(
            content_type=None
        ) if r.content_type == "application/json" else await r.text()


@pytest.fixture
async def clock() -> FakeClock:
    c = FakeClock()
    c.t = T + 3600
    return c


@pytest.fixture
def api_clock(clock: FakeClock) -> FakeClock:
    return clock


MG_AUTH = {"Authorization": "Basic " + base64.b64encode(f"api:{KEY}".encode()).decode()}
PM_AUTH = {"X-Postmark-Server-Token": KEY}
SG_AUTH = {"Authorization": f"Bearer {KEY}"}


# --- the fakes answer in the documented shapes ----------------------------------------------
async def test_mailgun_fake_answers_in_the_documented_shape(mailgun: FakeMailgun) -> None:
    doc = example("mailgun_events.json")
    mailgun.add(
        "rejected", T, message_id="<a@acme.example>", reason="Sandbox subdomains are for test purposes only."
    )
    mailgun.add("accepted", T + 1, message_id="<b@acme.example>", tag="acme:1")
    status, body = await get(
        mailgun, "/v3/mg.acme.example/events", MG_AUTH, {"begin": str(T - 1), "ascending": "yes"}
    )
    assert status == 200
    assert same_shape({k: doc[k] for k in ("paging",)}, body) == []
    assert set(body) == set(doc)
    assert same_shape(doc["items"][0], body["items"][0]) == []
    assert same_shape(doc["items"][1], body["items"][1]) == []
    # the last page is the empty one, and its `next` is still there (the documented behaviour)
    status, last = await get(mailgun, body["paging"]["next"].removeprefix(mailgun.base_url), MG_AUTH)
    assert (status, last["items"]) == (200, []) and "next" in last["paging"]


async def test_postmark_fake_answers_in_the_documented_shape(postmark: FakePostmark) -> None:
    postmark.add_message(T, tag="acme:1")
    postmark.add_bounce(T, email="gone@example.com")
    status, body = await get(postmark, "/messages/outbound", PM_AUTH, {"count": "10", "offset": "0"})
    assert status == 200
    assert same_shape(example("postmark_outbound.json"), body) == []
    status, body = await get(postmark, "/bounces", PM_AUTH, {"count": "10", "offset": "0"})
    assert status == 200
    assert same_shape(example("postmark_bounces.json"), body) == []


async def test_sendgrid_fake_answers_in_the_documented_shape(sendgrid: FakeSendgrid) -> None:
    detail = sendgrid.add_message(T, tag="acme:1")
    sendgrid.add_suppression(
        "bounces", email="gone@example.com", created=int(T), reason="550 5.1.1", status="5.1.1"
    )
    status, body = await get(
        sendgrid, "/v3/messages", SG_AUTH, {"query": 'msg_id="' + detail["msg_id"] + '"'}
    )
    assert status == 200
    assert same_shape(example("sendgrid_messages.json"), body) == []
    status, body = await get(sendgrid, f"/v3/messages/{detail['msg_id']}", SG_AUTH)
    assert status == 200
    assert same_shape(example("sendgrid_message.json"), body) == []
    status, body = await get(sendgrid, "/v3/suppression/bounces", SG_AUTH)
    assert status == 200
    assert same_shape(example("sendgrid_bounces.json"), body) == []


# --- the fakes refuse what the providers refuse ---------------------------------------------
async def test_the_fakes_refuse_a_wrong_or_missing_credential(
    mailgun: FakeMailgun, postmark: FakePostmark, sendgrid: FakeSendgrid
) -> None:
    wrong_basic = {"Authorization": "Basic " + base64.b64encode(b"api:nope").decode()}
    cases = [
        (mailgun, "/v3/mg.acme.example/events", wrong_basic),
        (mailgun, "/v3/mg.acme.example/events", {}),
        (postmark, "/messages/outbound?count=1&offset=0", {"X-Postmark-Server-Token": "nope"}),
        (postmark, "/messages/outbound?count=1&offset=0", SG_AUTH),  # a Bearer token is not Postmark's header
        (sendgrid, "/v3/messages?query=x", {"Authorization": "Bearer nope"}),
        (sendgrid, "/v3/messages?query=x", PM_AUTH),
    ]
    for fake, path, headers in cases:
        status, _ = await get(fake, path, headers)
        assert status == 401, (type(fake).__name__, headers)
    status, body = await get(postmark, "/messages/outbound?count=1&offset=0", {})
    assert status == 401 and body["ErrorCode"] == 10


async def test_the_fakes_refuse_requests_outside_the_documented_bounds(
    mailgun: FakeMailgun, postmark: FakePostmark, sendgrid: FakeSendgrid
) -> None:
    refused = [
        (mailgun, "/v3/mg.acme.example/events", MG_AUTH, {"limit": "301"}, 400),
        (mailgun, "/v3/mg.acme.example/events", MG_AUTH, {"begin": str(T)}, 400),  # no end, no ascending
        (mailgun, "/v3/other.example/events", MG_AUTH, {}, 404),
        (postmark, "/messages/outbound", PM_AUTH, {"count": "10"}, 422),  # offset required
        (postmark, "/messages/outbound", PM_AUTH, {"count": "501", "offset": "0"}, 422),
        (postmark, "/messages/outbound", PM_AUTH, {"count": "500", "offset": "9600"}, 422),
        (postmark, "/bounces", PM_AUTH, {"offset": "0"}, 422),
        (sendgrid, "/v3/messages", SG_AUTH, {}, 400),  # query required
        (sendgrid, "/v3/messages", SG_AUTH, {"query": 'msg_id="x"', "limit": "1001"}, 400),
        (sendgrid, "/v3/messages", SG_AUTH, {"query": "message_id=x"}, 400),
        (sendgrid, "/v3/messages/unknown", SG_AUTH, {}, 404),
    ]
    for fake, path, headers, params, want in refused:
        status, _ = await get(fake, path, headers, params)
        assert status == want, (path, params)


async def test_the_fakes_filter_as_documented(
    mailgun: FakeMailgun, postmark: FakePostmark, sendgrid: FakeSendgrid
) -> None:
    mailgun.add("accepted", T, message_id="a@x", tag="acme:1")
    mailgun.add("delivered", T + 5, message_id="a@x", tag="acme:1")
    mailgun.add("accepted", T + 10, message_id="b@x", tag="acme:2")
    _, body = await get(
        mailgun,
        "/v3/mg.acme.example/events",
        MG_AUTH,
        {"begin": str(T - 1), "end": str(T + 20), "event": "accepted OR rejected", "message-id": "a@x"},
    )
    assert [(i["event"], i["message"]["headers"]["message-id"]) for i in body["items"]] == [
        ("accepted", "a@x")
    ]
    _, desc = await get(
        mailgun, "/v3/mg.acme.example/events", MG_AUTH, {"begin": str(T + 20), "end": str(T - 1)}
    )
    assert [i["timestamp"] for i in desc["items"]] == [T + 10, T + 5, T]  # end < begin: newest first

    postmark.add_message(T, tag="acme:1")
    postmark.add_message(T + 60, tag="acme:2")
    # 2023-11-14T22:13:20Z is 17:13:20 in Eastern time, which is how Postmark reads the filter
    _, body = await get(
        postmark,
        "/messages/outbound",
        PM_AUTH,
        {"count": "10", "offset": "0", "metadata_smtpguard_key": "acme:1", "fromdate": "2023-11-14T17:13:00"},
    )
    assert [m["Metadata"]["smtpguard_key"] for m in body["Messages"]] == ["acme:1"] and body[
        "TotalCount"
    ] == 1
    _, none = await get(
        postmark,
        "/messages/outbound",
        PM_AUTH,
        {"count": "10", "offset": "0", "fromdate": "2023-11-14T22:14:00"},
    )
    assert none["TotalCount"] == 0  # read as Eastern, 22:14 there is after both messages

    a = sendgrid.add_message(T, tag="acme:1")
    sendgrid.add_message(T + 60, tag='acme:"2"')
    _, body = await get(
        sendgrid, "/v3/messages", SG_AUTH, {"query": "unique_args['smtpguard_key']=\"acme:1\""}
    )
    assert [m["msg_id"] for m in body["messages"]] == [a["msg_id"]]
    _, body = await get(
        sendgrid, "/v3/messages", SG_AUTH, {"query": 'unique_args[\'smtpguard_key\']="acme:\\"2\\""'}
    )
    assert len(body["messages"]) == 1
    q = 'last_event_time BETWEEN TIMESTAMP "2023-11-14T22:13:30Z" AND TIMESTAMP "2023-11-14T23:00:00Z"'
    _, body = await get(sendgrid, "/v3/messages", SG_AUTH, {"query": q})
    assert len(body["messages"]) == 1


async def test_an_entry_is_visible_only_after_its_delay(mailgun: FakeMailgun, clock: FakeClock) -> None:
    mailgun.add("accepted", T, message_id="a@x", delay=30)
    params = {"begin": str(T - 1), "ascending": "yes"}
    _, body = await get(mailgun, "/v3/mg.acme.example/events", MG_AUTH, params)
    assert body["items"] == []
    clock.t += 30
    _, body = await get(mailgun, "/v3/mg.acme.example/events", MG_AUTH, params)
    assert len(body["items"]) == 1


async def test_faults_on_demand_answer_then_clear(sendgrid: FakeSendgrid) -> None:
    sendgrid.fail(429, times=1, retry_after="7")
    sendgrid.fail(500)
    async with aiohttp.ClientSession() as s:
        async with s.get(sendgrid.base_url + "/v3/messages?query=msg_id%3D%22x%22", headers=SG_AUTH) as r:
            assert (r.status, r.headers.get("Retry-After")) == (429, "7")
        async with s.get(sendgrid.base_url + "/v3/messages?query=msg_id%3D%22x%22", headers=SG_AUTH) as r:
            assert r.status == 500
        async with s.get(sendgrid.base_url + "/v3/messages?query=msg_id%3D%22x%22", headers=SG_AUTH) as r:
            assert r.status == 200
    assert len(sendgrid.requests) == 3


# --- the clients read the documentation's own examples --------------------------------------
def test_the_mailgun_client_reads_the_documented_events() -> None:
    client = MailgunLog(provider="primary", base_url="https://api.mailgun.net", key=KEY, domain="example.org")
    rejected, accepted = (client._entry(i) for i in example("mailgun_events.json")["items"])
    assert rejected is not None and accepted is not None
    assert (rejected.kind, rejected.reason) == (
        LogKind.REFUSED,
        "Sandbox subdomains are for test purposes only.",
    )
    assert rejected.message_id == "20180622220256.1.B31A451A2E5422BB@sandbox55887.mailgun.org"
    assert rejected.at == 1529704976.104692
    assert (accepted.kind, accepted.tag) == (LogKind.ACCEPTED, "acme:invoice-1044")
    assert accepted.upstream_id == "20180812211713.1.DF5966851B4BAA99@example.org"


def test_the_postmark_client_reads_the_documented_messages_and_bounces() -> None:
    client = PostmarkLog(provider="standby", base_url="https://api.postmarkapp.com", key=KEY)
    (msg,) = example("postmark_outbound.json")["Messages"]
    entry = client._entry(msg)
    assert entry is not None
    assert (entry.kind, entry.upstream_id, entry.tag) == (
        LogKind.ACCEPTED,
        "0ac29aee-e1cd-480d-b08d-4f48548ff48d",
        None,
    )
    assert entry.at == pytest.approx(1392899101.4178645)  # 07:25:01.4178645-05:00
    (bounce,) = example("postmark_bounces.json")["Bounces"]
    reported = client._reported(bounce)
    assert reported is not None
    assert (reported.kind, reported.recipient) == (Reported.BOUNCE, "anything@blackhole.postmarkapp.com")
    assert reported.event_id == "Bounce:692560173"
    assert reported.match.upstream_ids == ("2c1b63fe-43f2-4db5-91b0-8bdfa44a9316",)


def test_the_sendgrid_client_reads_the_documented_suppressions() -> None:
    client = SendgridLog(provider="third", base_url="https://api.sendgrid.com", key=KEY)
    rows = [client._reported(r, "bounces", Reported.BOUNCE) for r in example("sendgrid_bounces.json")]
    assert [(r.recipient, r.status, r.at) for r in rows if r is not None] == [
        ("bounce1@test.com", "5.1.1", 1443651125.0),
        ("bounce2@test.com", "5.1.1", 1443651141.0),
    ]
    again = client._reported(example("sendgrid_bounces.json")[0], "bounces", Reported.BOUNCE)
    # read twice, one id
    assert again is not None and rows[0] is not None and again.event_id == rows[0].event_id
