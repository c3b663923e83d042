"""Webhook verdicts (DESIGN.md §19): a signed event that proves the provider took the message
settles its `unknown` record as `delivered`, audited `verdict:SOURCE`, with no `api` and no
`verdicts:` section configured. A real client, a real guard on a real SQLite file or
redis-server, a recording upstream that takes the message and drops the connection before
its 250 (the lost reply), then a webhook signed the way its provider signs. Every test counts
what the upstream received: the client's retry after the verdict is answered `250 …
duplicate` and nothing more is sent."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard import desk
from smtpguard.policy.ledger import Record, State
from smtpguard.server import Server
from tests.events.test_events import RCPT, events_config, events_port
from tests.support import Behaviour, Upstream, message, running_guard, send
from tests.support import events as ev
from tests.support.utf8 import store_overrides


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=9)


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]) -> AsyncIterator[Server]:
    cfg = events_config(tmp, upstream, keys, store)
    # Each test loses one 250 per source kind on purpose; the breaker is not under test.
    cfg["breaker"] = {"failure_threshold": 100}
    assert "verdicts" not in cfg and "reconcile" not in cfg
    assert all("api" not in p for p in cfg["providers"])
    async with running_guard(cfg) as server:
        yield server


async def lost_reply(server: Server, upstream: Upstream, key: str) -> tuple[Record, str]:
    """The provider takes the message and the connection drops before its 250: `unknown`."""
    before = len(upstream.received)
    upstream.handler.script = [Behaviour(drop_after_dot=True)]
    reply = await send(server.ports[0], message(key, to=RCPT), recipients=[RCPT])
    assert reply.code == 451, reply
    assert len(upstream.received) == before + 1
    message_id = upstream.received[-1].header("Message-ID") or ""
    record = await record_of(server, key)
    assert record.state is State.UNKNOWN and record.via == "primary", record
    # Held: the client's retry sends nothing.
    again = await send(server.ports[0], message(key, to=RCPT), recipients=[RCPT])
    assert again.code == 451 and "4.3.0" in again.text, again
    assert len(upstream.received) == before + 1
    return record, message_id


async def record_of(server: Server, key: str) -> Record:
    assert server.store is not None
    record = await server.store.get("acme", key)
    assert record is not None
    return record


def acceptance(kind: str, keys: ev.Keys, record: Record, message_id: str, event: str) -> ev.Signed:
    """A signed acceptance as each provider reports it, naming the message the way it can:
    no provider saw its own 250 reach smtpguard, so none can be matched by the upstream id."""
    tag = f"{record.zone}:{record.key}"
    if kind == "mailgun":
        return ev.mailgun(keys, ev.mailgun_event(event, RCPT, message_id))
    if kind == "sendgrid":
        return ev.sendgrid(keys, [ev.sendgrid_event(event, RCPT, message_id)])
    if kind == "resend":
        headers = [{"name": "X-Smtpguard-Id", "value": record.sg_id}]
        return ev.svix(keys, ev.resend_event(event, RCPT, f"re_{secrets.token_hex(8)}", headers=headers))
    if kind == "postmark":
        payload = ev.postmark_record("Delivery", RCPT, f"pm-{secrets.token_hex(8)}")
        payload["Metadata"] = {"smtpguard_key": tag}
        return ev.postmark(keys, payload)
    ses = ev.ses_message("Delivery", RCPT, message_id, f"0100{secrets.token_hex(8)}")
    if event == "Send":
        ses = {k: v for k, v in ses.items() if k != "delivery"} | {"eventType": "Send", "send": {}}
        del ses["notificationType"]
    return ev.ses(keys, ses)


ACCEPTING = [
    ("mailgun", "accepted"),
    ("mailgun", "delivered"),
    ("sendgrid", "processed"),
    ("sendgrid", "delivered"),
    ("resend", "email.sent"),
    ("resend", "email.delivered"),
    ("postmark", "Delivery"),
    ("ses", "Send"),
    ("ses", "Delivery"),
]


async def test_each_source_kind_settles_an_unknown_record_and_the_retry_is_a_duplicate(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    for n, (kind, event) in enumerate(ACCEPTING):
        key = f"invoice:{n}"
        record, message_id = await lost_reply(guard, upstream, key)
        signed = acceptance(kind, keys, record, message_id, event)
        status, doc = await ev.post(events_port(guard), kind, signed)
        assert status == 200 and doc["applied"] == 1, (kind, event, doc)

        settled = await record_of(guard, key)
        assert settled.state is State.DELIVERED, (kind, event, settled.state)
        last = settled.audit[-1]
        assert (last.actor, last.action, last.from_state, last.to_state) == (
            f"verdict:{kind}",
            "verdict:accepted",
            "unknown",
            "delivered",
        )
        assert last.note.startswith(f"verdict accepted via events {kind}"), last.note
        assert desk.last_decision(settled) == last

        reply = await send(guard.ports[0], message(key, to=RCPT), recipients=[RCPT])
        assert reply.code == 250 and "duplicate" in reply.text, (kind, event, reply)
    metrics = guard.metrics.render().decode()
    assert f'smtpguard_verdicts_total{{provider="primary",verdict="accepted"}} {len(ACCEPTING)}.0' in metrics
    # One upstream copy per event, whatever came back.
    assert len(upstream.received) == len(ACCEPTING)
    assert upstream.handler.transactions == len(ACCEPTING)


async def test_forged_or_unsigned_acceptances_settle_nothing(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    record, message_id = await lost_reply(guard, upstream, "invoice:forged")
    wrong = ev.mailgun(keys, ev.mailgun_event("delivered", RCPT, message_id), key="not-the-signing-key")
    unsigned = ev.sendgrid(keys, [ev.sendgrid_event("delivered", RCPT, message_id)])
    unsigned.headers = {k: v for k, v in unsigned.headers.items() if "Signature" not in k}
    genuine = acceptance("postmark", keys, record, message_id, "Delivery")
    guessed = ev.Signed(genuine.body, ev.postmark(keys, {}, password="guessed").headers)
    for source, signed in [("mailgun", wrong), ("sendgrid", unsigned), ("postmark", guessed)]:
        status, doc = await ev.post(events_port(guard), source, signed)
        assert status == 401, (source, status, doc)
    held = await record_of(guard, "invoice:forged")
    assert held.state is State.UNKNOWN and held.version == record.version
    reply = await send(guard.ports[0], message("invoice:forged", to=RCPT), recipients=[RCPT])
    assert reply.code == 451, reply
    assert len(upstream.received) == 1


async def test_an_acceptance_naming_another_records_tag_settles_only_that_one(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    done = await send(guard.ports[0], message("invoice:sent", to=RCPT), recipients=[RCPT])
    assert done.code == 250, done
    record, message_id = await lost_reply(guard, upstream, "invoice:held")
    # The held record's Message-ID, but the other record's tag: the tag decides (§18).
    data = ev.mailgun_event("delivered", RCPT, message_id, key="acme:invoice:sent")
    status, doc = await ev.post(events_port(guard), "mailgun", ev.mailgun(keys, data))
    assert status == 200, doc
    held = await record_of(guard, "invoice:held")
    assert held.state is State.UNKNOWN and held.version == record.version
    assert len(upstream.received) == 2


async def test_an_operator_decision_first_is_never_overridden(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    record, message_id = await lost_reply(guard, upstream, "invoice:decided")
    assert guard.store is not None
    decided = await desk.decide(
        guard.store, "acme", "invoice:decided", "retry", "console:alice", record.version
    )
    assert decided.state is State.DEFERRED
    status, doc = await ev.post(
        events_port(guard), "mailgun", acceptance("mailgun", keys, record, message_id, "delivered")
    )
    assert status == 200 and doc["applied"] == 1, doc  # the history keeps the event
    after = await record_of(guard, "invoice:decided")
    assert after.state is State.DEFERRED and after.version == decided.version
    assert [a.actor for a in after.audit if a.actor.startswith("verdict:")] == []
    assert desk.last_decision(after) == decided.audit[-1]
    assert (decided.audit[-1].actor, decided.audit[-1].action) == ("console:alice", "resolve:retry")
    assert len(upstream.received) == 1


async def test_an_acceptance_naming_only_a_message_id_two_records_share_settles_neither(
    guard: Server, upstream: Upstream, keys: ev.Keys
) -> None:
    """The application reused its own Message-ID under a new key: the provider's late
    acceptance of the first message names only that Message-ID. It proves nothing about
    the second, held `unknown`: settling that one `delivered` would lose it."""
    shared = {"Message-ID": "<invoice-7@app.acme.example>"}
    first = await send(guard.ports[0], message("reuse:1", to=RCPT, headers=shared), recipients=[RCPT])
    assert first.code == 250, first
    upstream.handler.script = [Behaviour(drop_after_dot=True)]
    lost = await send(guard.ports[0], message("reuse:2", to=RCPT, headers=shared), recipients=[RCPT])
    assert lost.code == 451, lost
    held = await record_of(guard, "reuse:2")
    assert held.state is State.UNKNOWN
    data = ev.mailgun_event("delivered", RCPT, shared["Message-ID"])
    status, doc = await ev.post(events_port(guard), "mailgun", ev.mailgun(keys, data))
    assert status == 200, doc
    after = await record_of(guard, "reuse:2")
    assert after.state is State.UNKNOWN and after.version == held.version, after.audit[-1:]
    # Its own tag settles it: the provider's word about this record's message.
    mine = ev.mailgun_event("delivered", RCPT, shared["Message-ID"], key="acme:reuse:2")
    status, doc = await ev.post(events_port(guard), "mailgun", ev.mailgun(keys, mine))
    assert status == 200, doc
    assert (await record_of(guard, "reuse:2")).state is State.DELIVERED
    assert len(upstream.received) == 2
