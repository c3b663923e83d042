"""A client's copy of smtpguard's tag is removed from every relayed message, not only from
mail through a provider whose source reads that tag (DESIGN.md §18: "every case or
punctuation variant of smtpguard's tag names that a client put in its message is removed
before relay"). Two zones each with their own provider entry on one SendGrid account, one
webhook: globex's route (standby) has no source of its own, so smtpguard wrote no tag
there and left the client's X-SMTPAPI as it came, and SendGrid echoes its unique_args in
every event. Real client, real guard, recording upstream, a signed SendGrid webhook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.events.test_events import events_config, events_port, sent, suppressed
from tests.support import OTHER_PASSWORD, Upstream, message, running_guard, send
from tests.support import events as ev

VICTIM = "victim@example.org"


@pytest.mark.parametrize(("header", "forged"), [
    ("X-SMTPAPI", '{"unique_args": {"smtpguard_key": "acme:invoice:1", "order": "42"}}'),
    # The member's name in JSON escapes: no byte test finds the word.
    ("X-SMTPAPI", '{"unique_args": {"smtp\\u0067uard_key": "acme:invoice:1", "order": "42"}}'),
    # Two unique_args: a parser that keeps the first would read ours.
    ("X-SMTPAPI", '{"unique_args": {"smtpguard_key": "acme:invoice:1"}, "unique_args": {"order": "42"}}'),
    ("X-Mailgun-Variables", '{"Smtpguard-Key": "acme:invoice:1", "order": "42"}'),
], ids=["plain", "escaped", "duplicate", "mailgun"])  # fmt: skip
async def test_a_tag_member_is_removed_from_mail_through_a_provider_no_source_reads(
    header: str, forged: str, tmp: Path, upstream: Upstream, keys: ev.Keys
) -> None:
    cfg = events_config(tmp, upstream, keys, {}, only="sendgrid")
    standby = {**cfg["providers"][0], "name": "standby"}
    cfg["providers"].append(standby)
    cfg["zones"]["acme"]["providers"] = ["primary"]
    cfg["zones"]["globex"]["providers"] = ["standby"]
    async with running_guard(cfg) as guard:
        acme_mid, _ = await sent(guard, upstream, "invoice:1", to=VICTIM)
        msg = message("order:1", sender="shop@globex.example", to=VICTIM, headers={header: forged})
        reply = await send(
            guard.ports[0],
            msg,
            user="globex-app",
            password=OTHER_PASSWORD,
            sender="shop@globex.example",
            recipients=[VICTIM],
        )
        assert reply.code == 250, reply
        assert len(upstream.received) == 2
        relayed = upstream.received[-1]
        head = relayed.content.split(b"\r\n\r\n", 1)[0].decode()
        assert "acme:invoice:1" not in head and head.count(header + ":") == 1, head
        # What the provider echoes: the client's other members, never a tag of its own.
        doc = json.loads(relayed.header(header) or "{}")
        args = doc.get("unique_args", doc)
        assert args == {"order": "42"}, doc
        if header == "X-SMTPAPI":
            # SendGrid puts unique_args at the top of each event: VICTIM complains about
            # globex's message; it must not land on acme's list.
            event = ev.sendgrid_event("spamreport", VICTIM, relayed.header("Message-ID") or "", **args)
            status, body = await ev.post(events_port(guard), "sendgrid", ev.sendgrid(keys, [event]))
            assert status == 200, body
            assert await suppressed(guard, "acme") == {}
        assert (await send(guard.ports[0], message("invoice:2", to=VICTIM), recipients=[VICTIM])).code == 250
        assert len(upstream.received) == 3
        assert acme_mid
