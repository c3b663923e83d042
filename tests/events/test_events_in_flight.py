"""An event about a send still in flight (the final dot sent, its outcome not yet written)
is answered 503, so the provider retries, never `200 unmatched` and lost (DESIGN.md §18).
A real client submits through the guard to an upstream that holds its 250 back; the
provider's signed webhook arrives in that window; the upstream count stays one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.events.test_events import RCPT, events_config, events_port, suppressed
from tests.support import Behaviour, Upstream, message, running_guard, send
from tests.support import events as ev
from tests.support.utf8 import store_overrides


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=8)


def _bounce(kind: str, keys: ev.Keys, message_id: str, sg_id: str) -> ev.Signed:
    if kind == "mailgun":
        event = ev.mailgun_event("failed", RCPT, message_id, severity="permanent", key="acme:invoice:1")
        return ev.mailgun(keys, event)
    headers = [{"name": "X-Smtpguard-Id", "value": sg_id}]
    return ev.svix(keys, ev.resend_event("email.bounced", RCPT, "re-not-yet-known", headers=headers))


@pytest.mark.parametrize("kind", ["mailgun", "resend"])
async def test_a_webhook_for_a_send_in_flight_is_503_then_applied_once(
    kind: str, tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]
) -> None:
    async with running_guard(events_config(tmp, upstream, keys, store, only=kind)) as guard:
        upstream.handler.default = Behaviour(hang_after_dot=1.5)
        sending = asyncio.create_task(send(guard.ports[0], message("invoice:1", to=RCPT), recipients=[RCPT]))
        await asyncio.wait_for(upstream.handler.arrived.wait(), 10)
        assert guard.store is not None
        record = await guard.store.get("acme", "invoice:1")
        assert record is not None and record.state.value == "in_flight" and record.via == "primary"
        message_id = upstream.received[0].header("Message-ID") or ""
        signed = _bounce(kind, keys, message_id, record.sg_id)
        status, doc = await ev.post(events_port(guard), kind, signed)
        assert status == 503, doc
        assert await suppressed(guard, "acme") == {}
        assert (await sending).code == 250
        # The provider's retry, once the outcome is written: applied, once.
        status, doc = await ev.post(events_port(guard), kind, signed)
        assert (status, doc["applied"]) == (200, 1), doc
        assert list(await suppressed(guard, "acme")) == [RCPT]
        status, doc = await ev.post(events_port(guard), kind, signed)
        assert (status, doc["duplicate"]) == (200, 1), doc
        assert len(await guard.store.provider_events("acme", "invoice:1")) == 1
        reply = await send(guard.ports[0], message("invoice:2", to=RCPT), recipients=[RCPT])
        assert reply.code == 550
        assert len(upstream.received) == 1
