"""The log is searched by smtpguard's tag (DESIGN.md §19), so a provider with an `api` gets
the tag written on every relayed message even when no events source reads its webhooks, in
the one spelling §18 allows, beside the Message-ID it is also found by."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import Upstream, message, running_guard, send
from tests.support.verdicts import API_ENV, API_KEY, message_id_of, tag_of, verdict_config


@pytest.mark.parametrize("kind", ["mailgun", "postmark", "sendgrid"])
async def test_a_provider_with_an_api_gets_the_tag_without_an_events_source(
    tmp: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    cfg = verdict_config(tmp, upstream.port, f"sqlite:///{tmp / 'state.db'}", kind, "http://127.0.0.1:9")
    assert "events" not in cfg
    forged = {"X-PM-Metadata-smtpguard_key": "globex:someone-else"}
    async with running_guard(cfg) as guard:
        assert (await send(guard.ports[0], message("tag:1", headers=forged))).code == 250
        assert guard.store is not None
        rec = await guard.store.get("acme", "tag:1")
    assert rec is not None and rec.message_id is not None
    [got] = upstream.received
    assert tag_of(got, kind) == "acme:tag:1"
    assert message_id_of(got) == rec.message_id
    assert "globex:someone-else" not in got.content.decode()
