"""Mailgun's signed timestamp read as ASCII digits (events/sources/base.py `_fresh_seconds`)
still takes what a client of JSON may make of it: a JSON number (Mailgun writes a string;
a relay that re-serialises the payload may write the number) is the same digits and
verifies; a float, a boolean or an exponent is no Unix time in whole seconds. Posted to a
real events listener; the event's effect is read back through the CLI's history."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from tests.events.test_events import RCPT, events_config, events_port, sent
from tests.events.test_outsider_signatures import _history_events, _mailgun_signed
from tests.support import Upstream, running_guard
from tests.support import events as ev


async def test_a_mailgun_timestamp_sent_as_a_json_number_verifies(
    tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    cfg = events_config(tmp, upstream, keys, {}, only="mailgun")
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        message_id, _ = await sent(guard, upstream, "mgnum:1")
        now = int(time.time())
        payload: dict[str, Any] = _mailgun_signed(
            keys.mailgun, str(now), secrets.token_hex(25), ev.mailgun_event("delivered", RCPT, message_id)
        )
        payload["signature"]["timestamp"] = now
        status, doc = await ev.post(
            events_port(guard), "mailgun", ev.Signed(json.dumps(payload).encode(), {})
        )
        assert status == 200 and doc["applied"] == 1, doc
        assert await _history_events(tmp, "mgnum:1") == ["delivered"]
    assert upstream.event_keys() == ["mgnum:1"]


@pytest.mark.parametrize("as_json", ["{now}.0", "{now}e0", "true", "1e400"])
async def test_a_mailgun_timestamp_that_is_no_whole_number_is_401(
    tmp: Path, upstream: Upstream, keys: ev.Keys, as_json: str
) -> None:
    """Signed over what str() makes of the value, so only the reading refuses it: a JSON
    float is no field of the signature at all, `true` (an int to Python) no digits."""
    cfg = events_config(tmp, upstream, keys, {}, only="mailgun")
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        message_id, _ = await sent(guard, upstream, "mgbad:1")
        value = json.loads(as_json.format(now=int(time.time())))
        payload: dict[str, Any] = _mailgun_signed(
            keys.mailgun, str(value), secrets.token_hex(25), ev.mailgun_event("failed", RCPT, message_id)
        )
        payload["signature"]["timestamp"] = value
        status, doc = await ev.post(
            events_port(guard), "mailgun", ev.Signed(json.dumps(payload).encode(), {})
        )
        assert status == 401, doc
        assert await _history_events(tmp, "mgbad:1") == []
    assert upstream.event_keys() == ["mgbad:1"]
