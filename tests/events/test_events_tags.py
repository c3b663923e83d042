"""Tags have one spelling (DESIGN.md §18): an event finds a record only through the tag
smtpguard wrote or ids the provider assigned. A client's look-alike of a tag name, in any
case or punctuation, never reaches the provider, and a key that cannot be a header value
is written encoded. Real client, real guard, recording upstream, signed webhooks; the
victim's next message is counted at the upstream."""

from __future__ import annotations

import email.policy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard.policy.events import tag_value
from tests.events.test_events import RCPT, events_config, events_port, sent, suppressed
from tests.support import OTHER_PASSWORD, Upstream, message, running_guard, send
from tests.support import events as ev
from tests.support.utf8 import store_overrides


@pytest.fixture(params=["sqlite"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=8)


LOOK_ALIKES = (
    "X-PM-Metadata-smtpguard-key",
    "X-PM-Metadata-SMTPGuard.Key",
    "x-pm-metadata-SMTPGUARD_KEY",
    "X-Smtpguard_Id",
    "Smtpguard-Key",
)
VICTIM = "victim@example.org"


def _metadata(content: bytes) -> dict[str, str]:
    """What Postmark turns the relayed message's X-PM-Metadata-* fields into."""
    out: dict[str, str] = {}
    for line in content.split(b"\r\n\r\n", 1)[0].decode().split("\r\n"):
        name, _, value = line.partition(":")
        if name.lower().startswith("x-pm-metadata-"):
            out.setdefault(name[len("x-pm-metadata-") :], value.strip())
    return out


async def _globex_sends(guard: Any, key: str, headers: dict[str, str]) -> None:
    msg = message(key, sender="shop@globex.example", to=VICTIM, headers=headers)
    # A key outside ASCII travels as UTF-8 in the header, as an application writes it.
    raw = msg.as_bytes(policy=email.policy.SMTPUTF8).replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    reply = await send(
        guard.ports[0],
        raw,
        user="globex-app",
        password=OTHER_PASSWORD,
        sender="shop@globex.example",
        recipients=[VICTIM],
    )
    assert reply.code == 250, reply


@pytest.mark.parametrize("globex_key", ["order:1", "ordér:1"], ids=["ascii", "not-ascii"])
async def test_a_look_alike_postmark_tag_from_another_zone_is_stripped(
    globex_key: str, tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]
) -> None:
    async with running_guard(events_config(tmp, upstream, keys, store, only="postmark")) as guard:
        await sent(guard, upstream, "invoice:1", to=VICTIM)
        await _globex_sends(guard, globex_key, {name: "acme:invoice:1" for name in LOOK_ALIKES})
        assert len(upstream.received) == 2
        relayed = upstream.received[-1].content
        head = relayed.split(b"\r\n\r\n", 1)[0].decode()
        assert "acme:invoice:1" not in head
        # Ours, in the one spelling, and never left out.
        metadata = _metadata(relayed)
        assert metadata == {"smtpguard_key": tag_value(f"globex:{globex_key}")}
        complaint = ev.postmark_record("SpamComplaint", VICTIM, "pm-unknown-id")
        complaint["Metadata"] = metadata
        status, doc = await ev.post(events_port(guard), "postmark", ev.postmark(keys, complaint))
        assert (status, doc["applied"]) == (200, 1), doc
        assert await suppressed(guard, "acme") == {}
        assert set(await suppressed(guard, "globex")) == {VICTIM}
        # acme's next mail to that address still goes out.
        assert (await send(guard.ports[0], message("invoice:2", to=VICTIM), recipients=[VICTIM])).code == 250
        assert len(upstream.received) == 3


@pytest.mark.parametrize("spelling", ["smtpguard-key", "SMTPGuard.Key", "smtpguard_KEY"])
async def test_the_postmark_reader_takes_only_the_spelling_smtpguard_writes(
    spelling: str, tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]
) -> None:
    async with running_guard(events_config(tmp, upstream, keys, store, only="postmark")) as guard:
        await sent(guard, upstream, "invoice:1")
        payload = ev.postmark_bounce(RCPT, "pm-unknown-id")
        payload["Metadata"] = {spelling: "acme:invoice:1"}
        status, doc = await ev.post(events_port(guard), "postmark", ev.postmark(keys, payload))
        assert (status, doc["unmatched"]) == (200, 1), doc
        assert await suppressed(guard, "acme") == {}
        assert (await send(guard.ports[0], message("invoice:2", to=RCPT), recipients=[RCPT])).code == 250
        assert len(upstream.received) == 2


@pytest.mark.parametrize(("kind", "header"), [("mailgun", "X-Mailgun-Variables"), ("sendgrid", "X-SMTPAPI")])
async def test_look_alike_members_of_the_json_tag_headers_are_removed(
    kind: str, header: str, tmp: Path, upstream: Upstream, keys: ev.Keys, store: dict[str, Any]
) -> None:
    async with running_guard(events_config(tmp, upstream, keys, store, only=kind)) as guard:
        members = {"smtpguard-key": "acme:invoice:1", "SMTPGuard.Key": "acme:invoice:1", "order": "42"}
        own = json.dumps(members if kind == "mailgun" else {"unique_args": members})
        await _globex_sends(guard, "order:1", {header: own})
        doc = json.loads(upstream.received[-1].header(header) or "")
        args = doc if kind == "mailgun" else doc["unique_args"]
        assert args == {"order": "42", "smtpguard_key": "globex:order:1"}
