"""Provider events end to end (DESIGN.md §13): a real message through the proxy to a
recording upstream, then a webhook signed the way its provider signs, then what changed —
the zone's suppression list, `history --json`, the next submission to that recipient (550
5.1.1 at RCPT, nothing upstream) — counted at the upstream every time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard.cli import main
from smtpguard.server import Server
from tests.support import (
    OTHER_PASSWORD,
    Upstream,
    base_config,
    message,
    running_guard,
    send,
    suppressions_refreshed,
)
from tests.support import events as ev
from tests.support.utf8 import store_overrides

RCPT = "gone@example.net"


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=8)


def events_config(
    tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any], **more: Any
) -> dict[str, Any]:
    sources = keys.sources()
    only = more.pop("only", None)
    if only is not None:
        sources = {only: sources[only]}
    events = {"address": "127.0.0.1:0", "sources": sources, **more.pop("events", {})}
    return base_config(tmp, upstream.port, events=events, **store, **more)


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]) -> AsyncIterator[Server]:
    cfg = events_config(tmp, upstream, keys, store)
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as server:
        yield server


def events_port(server: Server) -> int:
    assert server.events is not None
    return server.events.port


async def sent(server: Server, upstream: Upstream, key: str, to: str = RCPT, **kw: Any) -> tuple[str, str]:
    """Send one event through the proxy; the Message-ID and queue id the upstream saw."""
    before = len(upstream.received)
    reply = await send(server.ports[0], message(key, to=to, **kw), recipients=[to])
    assert reply.code == 250, reply
    assert len(upstream.received) == before + 1
    got = upstream.received[-1]
    message_id = got.header("Message-ID")
    assert message_id
    return message_id, f"Q{len(upstream.received)}"


async def history(tmp: Path, zone: str, key: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert (
        await asyncio.to_thread(main, ["history", zone, key, "--json", "-c", str(tmp / "smtpguard.yaml")])
        == 0
    )
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


async def suppressed(server: Server, zone: str) -> dict[str, str]:
    assert server.store is not None
    return {s.address: s.reason for s in await server.store.suppress_list(zone)}


def bounce_for(kind: str, keys: ev.Keys, message_id: str, queue_id: str, to: str = RCPT) -> ev.Signed:
    """A hard bounce as each provider reports it, naming the message the way it does."""
    if kind == "mailgun":
        return ev.mailgun(keys, ev.mailgun_event("failed", to, message_id, severity="permanent"))
    if kind == "sendgrid":
        return ev.sendgrid(keys, [ev.sendgrid_event("bounce", to, message_id)])
    if kind == "resend":
        return ev.svix(keys, ev.resend_event("email.bounced", to, queue_id))
    if kind == "postmark":
        return ev.postmark(keys, ev.postmark_bounce(to, queue_id))
    return ev.ses(keys, ev.ses_message("Bounce", to, message_id, queue_id))


BOUNCE_STATUS = {
    "mailgun": "550",
    "sendgrid": "5.0.0",
    "resend": "Permanent/General",
    "postmark": "HardBounce",
    "ses": "5.1.1",
}
KINDS = list(BOUNCE_STATUS)


# --- the effects table -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
async def test_hard_bounce_suppresses_the_recipient_and_the_next_send_goes_nowhere(
    kind: str, guard: Server, upstream: Upstream, keys: ev.Keys, tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message_id, queue_id = await sent(guard, upstream, "invoice:1044")
    status, doc = await ev.post(events_port(guard), kind, bounce_for(kind, keys, message_id, queue_id))
    assert status == 200 and doc["applied"] == 1, doc

    reason = f"bounce {BOUNCE_STATUS[kind]} via {kind}"
    assert await suppressed(guard, "acme") == {RCPT: reason}
    record = await history(tmp, "acme", "invoice:1044", capsys)
    assert [(e["source"], e["type"], e["recipient"], e["effect"]) for e in record["events"]] == [
        (kind, "bounce", RCPT, "suppressed")
    ]
    assert {"at", "source", "type", "recipient", "status", "id"} <= set(record["events"][0])

    # The next event for that recipient is refused at RCPT, within the cache's refresh.
    suppressions_refreshed(guard)
    reply = await send(guard.ports[0], message("invoice:1045", to=RCPT), recipients=[RCPT])
    assert reply.code == 550 and "5.1.1" in reply.text, reply
    assert len(upstream.received) == 1


def complaint_for(kind: str, keys: ev.Keys, message_id: str, queue_id: str) -> ev.Signed:
    if kind == "mailgun":
        return ev.mailgun(keys, ev.mailgun_event("complained", RCPT, message_id))
    if kind == "sendgrid":
        return ev.sendgrid(keys, [ev.sendgrid_event("spamreport", RCPT, message_id)])
    if kind == "resend":
        return ev.svix(keys, ev.resend_event("email.complained", RCPT, queue_id))
    if kind == "postmark":
        return ev.postmark(keys, ev.postmark_record("SpamComplaint", RCPT, queue_id))
    return ev.ses(keys, ev.ses_message("Complaint", RCPT, message_id, queue_id))


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
@pytest.mark.parametrize("kind", KINDS)
async def test_complaint_suppresses_with_its_reason(
    kind: str, guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    message_id, queue_id = await sent(guard, upstream, "newsletter:7")
    status, doc = await ev.post(events_port(guard), kind, complaint_for(kind, keys, message_id, queue_id))
    assert status == 200 and doc["applied"] == 1, doc
    assert await suppressed(guard, "acme") == {RCPT: f"complaint via {kind}"}


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("kind", "make"),
    [
        ("mailgun", lambda k, mid: ev.mailgun(k, ev.mailgun_event("unsubscribed", RCPT, mid))),
        ("sendgrid", lambda k, mid: ev.sendgrid(k, [ev.sendgrid_event("unsubscribe", RCPT, mid)])),
        ("sendgrid", lambda k, mid: ev.sendgrid(k, [ev.sendgrid_event("group_unsubscribe", RCPT, mid)])),
        (
            "sendgrid",
            lambda k, mid: ev.sendgrid(
                k, [ev.sendgrid_event("dropped", RCPT, mid, reason="Bounced Address", status="5.0.0")]
            ),
        ),
    ],
    ids=[
        "mailgun-unsubscribed",
        "sendgrid-unsubscribe",
        "sendgrid-group_unsubscribe",
        "sendgrid-dropped-bounced",
    ],
)
async def test_unsubscribe_and_a_drop_for_a_bounced_address_suppress(
    kind: str, make: Callable[[ev.Keys, str], ev.Signed], guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    message_id, _ = await sent(guard, upstream, "digest:3")
    status, doc = await ev.post(events_port(guard), kind, make(keys, message_id))
    assert status == 200 and doc["applied"] == 1, doc
    (reason,) = (await suppressed(guard, "acme")).values()
    assert reason in (f"unsubscribe via {kind}", f"bounce 5.0.0 via {kind}")


HISTORY_ONLY: list[tuple[str, str, Callable[[ev.Keys, str, str], ev.Signed]]] = [
    ("mailgun", "delivered", lambda k, mid, q: ev.mailgun(k, ev.mailgun_event("delivered", RCPT, mid))),
    (
        "mailgun",
        "soft_bounce",
        lambda k, mid, q: ev.mailgun(
            k, ev.mailgun_event("failed", RCPT, mid, severity="temporary", code=452)
        ),
    ),
    ("sendgrid", "delivered", lambda k, mid, q: ev.sendgrid(k, [ev.sendgrid_event("delivered", RCPT, mid)])),
    ("sendgrid", "deferred", lambda k, mid, q: ev.sendgrid(k, [ev.sendgrid_event("deferred", RCPT, mid)])),
    (
        "sendgrid",
        "soft_bounce",
        lambda k, mid, q: ev.sendgrid(k, [ev.sendgrid_event("bounce", RCPT, mid, type="blocked")]),
    ),
    ("sendgrid", "other", lambda k, mid, q: ev.sendgrid(k, [ev.sendgrid_event("open", RCPT, mid)])),
    ("resend", "delivered", lambda k, mid, q: ev.svix(k, ev.resend_event("email.delivered", RCPT, q))),
    ("resend", "deferred", lambda k, mid, q: ev.svix(k, ev.resend_event("email.delivery_delayed", RCPT, q))),
    (
        "postmark",
        "soft_bounce",
        lambda k, mid, q: ev.postmark(k, ev.postmark_bounce(RCPT, q, kind="SoftBounce")),
    ),
    ("postmark", "delivered", lambda k, mid, q: ev.postmark(k, ev.postmark_record("Delivery", RCPT, q))),
    ("ses", "delivered", lambda k, mid, q: ev.ses(k, ev.ses_message("Delivery", RCPT, mid, q))),
    (
        "ses",
        "soft_bounce",
        lambda k, mid, q: ev.ses(k, ev.ses_message("Bounce", RCPT, mid, q, bounce_type="Transient")),
    ),
]


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("kind", "meaning", "make"), HISTORY_ONLY, ids=[f"{k}-{m}" for k, m, _ in HISTORY_ONLY]
)
async def test_other_events_join_the_history_only(
    kind: str,
    meaning: str,
    make: Callable[[ev.Keys, str, str], ev.Signed],
    guard: Server,
    upstream: Upstream,
    keys: ev.Keys,
    tmp: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    message_id, queue_id = await sent(guard, upstream, "invoice:9")
    status, doc = await ev.post(events_port(guard), kind, make(keys, message_id, queue_id))
    assert status == 200 and doc["applied"] == 1, doc
    assert await suppressed(guard, "acme") == {}
    record = await history(tmp, "acme", "invoice:9", capsys)
    assert [(e["type"], e["effect"]) for e in record["events"]] == [(meaning, "history")]


# --- idempotent, order-independent, zone-bound -------------------------------------------------
async def test_the_same_event_twice_is_applied_once(
    guard: Server, upstream: Upstream, keys: ev.Keys, tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message_id, queue_id = await sent(guard, upstream, "invoice:1")
    signed = bounce_for("sendgrid", keys, message_id, queue_id)
    first = await ev.post(events_port(guard), "sendgrid", signed)
    again = await ev.post(events_port(guard), "sendgrid", signed)
    assert first == (200, {"status": "ok", "applied": 1, "duplicate": 0, "unmatched": 0})
    assert again == (200, {"status": "ok", "applied": 0, "duplicate": 1, "unmatched": 0})
    assert len((await history(tmp, "acme", "invoice:1", capsys))["events"]) == 1
    # Removed by an operator, the address stays off the list when the provider retries.
    assert guard.store is not None
    assert await guard.store.suppress_remove("acme", RCPT)
    assert (await ev.post(events_port(guard), "sendgrid", signed))[1]["duplicate"] == 1
    assert await suppressed(guard, "acme") == {}


async def test_a_later_delivered_never_lifts_a_suppression(
    guard: Server, upstream: Upstream, keys: ev.Keys, tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message_id, _ = await sent(guard, upstream, "invoice:2")
    bounce = ev.mailgun(keys, ev.mailgun_event("failed", RCPT, message_id, severity="permanent"))
    delivered = ev.mailgun(keys, ev.mailgun_event("delivered", RCPT, message_id))
    # Out of order: the delivery is reported after the bounce (and once more before it).
    for signed in (delivered, bounce, delivered):
        assert (await ev.post(events_port(guard), "mailgun", signed))[0] == 200
    assert await suppressed(guard, "acme") == {RCPT: "bounce 550 via mailgun"}
    kinds = [e["type"] for e in (await history(tmp, "acme", "invoice:2", capsys))["events"]]
    assert kinds == ["delivered", "bounce"]


async def test_an_event_for_zone_a_never_touches_zone_b(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    acme_mid, _ = await sent(guard, upstream, "invoice:1")
    reply = await send(
        guard.ports[0],
        message("order:1", sender="shop@globex.example", to=RCPT),
        user="globex-app",
        password=OTHER_PASSWORD,
        sender="shop@globex.example",
        recipients=[RCPT],
    )
    assert reply.code == 250
    status, doc = await ev.post(
        events_port(guard),
        "mailgun",
        ev.mailgun(keys, ev.mailgun_event("failed", RCPT, acme_mid, severity="permanent")),
    )
    assert status == 200 and doc["applied"] == 1
    assert await suppressed(guard, "acme") == {RCPT: "bounce 550 via mailgun"}
    assert await suppressed(guard, "globex") == {}
    again = await send(
        guard.ports[0],
        message("order:2", sender="shop@globex.example", to=RCPT),
        user="globex-app",
        password=OTHER_PASSWORD,
        sender="shop@globex.example",
        recipients=[RCPT],
    )
    assert again.code == 250 and len(upstream.received) == 3


async def test_a_message_id_two_zones_share_is_not_trusted(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    shared = "<1@localhost>"
    await sent(guard, upstream, "invoice:1", headers={"Message-ID": shared})
    reply = await send(
        guard.ports[0],
        message("order:1", sender="shop@globex.example", to=RCPT, headers={"Message-ID": shared}),
        user="globex-app",
        password=OTHER_PASSWORD,
        sender="shop@globex.example",
        recipients=[RCPT],
    )
    assert reply.code == 250
    # Mailgun names the message only by Message-ID: ambiguous, so nothing is applied.
    status, doc = await ev.post(
        events_port(guard),
        "mailgun",
        ev.mailgun(keys, ev.mailgun_event("failed", RCPT, shared, severity="permanent")),
    )
    assert (status, doc["unmatched"]) == (200, 1)
    # SendGrid also names the queue id of its 250, which is unique: that decides.
    signed = ev.sendgrid(keys, [ev.sendgrid_event("bounce", RCPT, shared, upstream="Q2")])
    status, doc = await ev.post(events_port(guard), "sendgrid", signed)
    assert (status, doc["applied"]) == (200, 1)
    assert await suppressed(guard, "acme") == {}
    assert await suppressed(guard, "globex") == {RCPT: "bounce 5.0.0 via sendgrid"}


async def test_an_unmatched_event_changes_nothing_and_is_counted(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    await sent(guard, upstream, "invoice:1")
    signed = ev.mailgun(keys, ev.mailgun_event("failed", RCPT, "<not-ours@elsewhere>", severity="permanent"))
    assert await ev.post(events_port(guard), "mailgun", signed) == (
        200,
        {"status": "ok", "applied": 0, "duplicate": 0, "unmatched": 1},
    )
    assert await suppressed(guard, "acme") == {}
    metrics = guard.metrics.render().decode()
    assert (
        'smtpguard_provider_events_total{outcome="unmatched",source="mailgun",type="bounce"} 1.0' in metrics
    )


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_events_match_only_records_of_the_sources_provider(
    tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]
) -> None:
    cfg = events_config(tmp, upstream, keys, store)
    standby = {"name": "standby", "kind": "maildir", "path": str(tmp / "standby")}
    cfg["providers"].append(standby)
    cfg["events"]["sources"]["mailgun"]["provider"] = "standby"
    async with running_guard(cfg) as guard:
        message_id, _ = await sent(guard, upstream, "invoice:1")
        signed = ev.mailgun(keys, ev.mailgun_event("failed", RCPT, message_id, severity="permanent"))
        assert (await ev.post(events_port(guard), "mailgun", signed))[1]["unmatched"] == 1
        assert await suppressed(guard, "acme") == {}


# --- the key the provider echoes --------------------------------------------------------------
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("kind", "header", "value"),
    [
        ("mailgun", "X-Mailgun-Variables", '{"smtpguard_key": "acme:invoice:77"}'),
        ("sendgrid", "X-SMTPAPI", '{"unique_args": {"smtpguard_key": "acme:invoice:77"}}'),
        ("postmark", "X-PM-Metadata-smtpguard_key", "acme:invoice:77"),
        ("resend", "X-Smtpguard-Id", "SGID"),
        ("ses", "X-Smtpguard-Id", "SGID"),
    ],
)
async def test_the_relayed_message_carries_its_identity_and_the_echo_finds_it(
    kind: str, header: str, value: str, tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]
) -> None:
    async with running_guard(events_config(tmp, upstream, keys, store, only=kind)) as guard:
        await sent(guard, upstream, "invoice:77")
        assert guard.store is not None
        record = await guard.store.get("acme", "invoice:77")
        assert record is not None
        assert upstream.received[0].header(header) == value.replace("SGID", record.sg_id)
        # Headers that reach the recipient never carry the key.
        if kind in ("resend", "ses"):
            assert b"invoice:77" not in upstream.received[0].content.split(b"X-Event-Key", 1)[0]
        # The provider rewrote the Message-ID and names no id of ours but the echo.
        other = "<provider-rewrote-it@mail.example>"
        signed: ev.Signed
        if kind == "mailgun":
            signed = ev.mailgun(
                keys, ev.mailgun_event("failed", RCPT, other, severity="permanent", key="acme:invoice:77")
            )
        elif kind == "sendgrid":
            signed = ev.sendgrid(
                keys, [ev.sendgrid_event("bounce", RCPT, other, smtpguard_key="acme:invoice:77")]
            )
        elif kind == "postmark":
            payload = ev.postmark_bounce(RCPT, "pm-unknown-id")
            payload["Metadata"] = {"smtpguard_key": "acme:invoice:77"}
            signed = ev.postmark(keys, payload)
        elif kind == "resend":
            headers = [{"name": "X-Smtpguard-Id", "value": record.sg_id}]
            signed = ev.svix(keys, ev.resend_event("email.bounced", RCPT, "re-unknown-id", headers=headers))
        else:
            m = ev.ses_message("Bounce", RCPT, other, "ses-unknown-id")
            m["mail"]["headers"] = [{"name": "X-Smtpguard-Id", "value": record.sg_id}]
            signed = ev.ses(keys, m)
        status, doc = await ev.post(events_port(guard), kind, signed)
        assert (status, doc["applied"]) == (200, 1), doc
        assert RCPT in await suppressed(guard, "acme")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_application_header_of_the_same_name_is_merged_not_duplicated(
    tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]
) -> None:
    async with running_guard(events_config(tmp, upstream, keys, store, only="sendgrid")) as guard:
        own = '{"category": "billing", "unique_args": {"order": "42"}}'
        await sent(guard, upstream, "invoice:1", headers={"X-SMTPAPI": own})
        head = upstream.received[0].content.split(b"\r\n\r\n", 1)[0]
        assert head.lower().count(b"x-smtpapi:") == 1
        assert json.loads(upstream.received[0].header("X-SMTPAPI") or "") == {
            "category": "billing",
            "unique_args": {"order": "42", "smtpguard_key": "acme:invoice:1"},
        }


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
@pytest.mark.parametrize("kind", ["mailgun", "resend"])
async def test_a_client_cannot_point_events_at_another_zones_record(
    kind: str, tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]
) -> None:
    """A globex client writes acme's key (or an acme record's smtpguard id) into the headers
    the provider echoes: smtpguard's own values replace them, so the bounce of globex's
    recipient lands on globex's list."""
    async with running_guard(events_config(tmp, upstream, keys, store, only=kind)) as guard:
        await sent(guard, upstream, "invoice:1")
        assert guard.store is not None
        acme = await guard.store.get("acme", "invoice:1")
        assert acme is not None
        forged = {
            "X-Mailgun-Variables": '{"smtpguard_key": "acme:invoice:1"}',
            "X-Smtpguard-Id": acme.sg_id,
            "X-Smtpguard-Key": "acme:invoice:1",
        }
        reply = await send(
            guard.ports[0],
            message("order:1", sender="shop@globex.example", to="victim@example.org", headers=forged),
            user="globex-app",
            password=OTHER_PASSWORD,
            sender="shop@globex.example",
            recipients=["victim@example.org"],
        )
        assert reply.code == 250
        relayed = upstream.received[-1]
        globex = await guard.store.get("globex", "order:1")
        assert globex is not None
        assert relayed.content.lower().count(b"x-smtpguard-id:") == (1 if kind == "resend" else 0)
        assert relayed.header("X-Smtpguard-Key") is None
        if kind == "mailgun":
            assert b"acme:invoice:1" not in relayed.content
        # The provider echoes what it was given: the relayed message's own values.
        if kind == "mailgun":
            variables = json.loads(relayed.header("X-Mailgun-Variables") or "")
            assert variables == {"smtpguard_key": "globex:order:1"}
            signed = ev.mailgun(
                keys,
                ev.mailgun_event(
                    "failed",
                    "victim@example.org",
                    "<x@y>",
                    severity="permanent",
                    key=variables["smtpguard_key"],
                ),
            )
        else:
            assert relayed.header("X-Smtpguard-Id") == globex.sg_id
            headers = [{"name": "X-Smtpguard-Id", "value": relayed.header("X-Smtpguard-Id") or ""}]
            signed = ev.svix(
                keys, ev.resend_event("email.bounced", "victim@example.org", "nope", headers=headers)
            )
        assert (await ev.post(events_port(guard), kind, signed))[1]["applied"] == 1
        assert await suppressed(guard, "acme") == {}
        assert "victim@example.org" in await suppressed(guard, "globex")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_every_relayed_message_carries_the_message_id_smtpguard_stored(
    guard: Server, upstream: Upstream, tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message_id, _ = await sent(guard, upstream, "invoice:5")
    assert message_id.startswith("<sg.") and message_id.endswith("@guard.test>")
    assert (await history(tmp, "acme", "invoice:5", capsys))["message_id"] == message_id


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_an_event_suppresses_only_an_address_the_message_was_sent_to(
    guard: Server, upstream: Upstream, keys: ev.Keys, tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message_id, _ = await sent(guard, upstream, "invoice:3")
    signed = ev.mailgun(
        keys, ev.mailgun_event("failed", "someone-else@example.org", message_id, severity="permanent")
    )
    assert (await ev.post(events_port(guard), "mailgun", signed))[1]["applied"] == 1
    assert await suppressed(guard, "acme") == {}
    (event,) = (await history(tmp, "acme", "invoice:3", capsys))["events"]
    assert (event["recipient"], event["effect"]) == ("someone-else@example.org", "not_a_recipient")


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
async def test_a_resend_bounce_of_a_many_recipient_email_suppresses_no_one(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    to = [RCPT, "second@example.net"]
    reply = await send(guard.ports[0], message("invoice:4", to=", ".join(to)), recipients=to)
    assert reply.code == 250
    payload = ev.resend_event("email.bounced", RCPT, "Q1")
    payload["data"]["to"] = to
    assert (await ev.post(events_port(guard), "resend", ev.svix(keys, payload)))[1]["applied"] == 2
    assert await suppressed(guard, "acme") == {}
    transient = ev.resend_event("email.bounced", RCPT, "Q1")
    transient["data"]["bounce"]["type"] = "Transient"
    assert (await ev.post(events_port(guard), "resend", ev.svix(keys, transient)))[1]["applied"] == 1
    assert await suppressed(guard, "acme") == {}


async def test_a_message_id_reused_within_one_zone_still_suppresses(
    guard: Server, upstream: Upstream, keys: ev.Keys, tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = "<resent@app.example>"
    await sent(guard, upstream, "invoice:1", headers={"Message-ID": shared})
    await sent(guard, upstream, "invoice:1-resend", headers={"Message-ID": shared}, subject="Invoice 1 again")
    signed = ev.mailgun(keys, ev.mailgun_event("failed", RCPT, shared, severity="permanent"))
    assert (await ev.post(events_port(guard), "mailgun", signed))[1]["applied"] == 1
    assert await suppressed(guard, "acme") == {RCPT: "bounce 550 via mailgun"}
    assert len((await history(tmp, "acme", "invoice:1-resend", capsys))["events"]) == 1
