"""The MAIL and RCPT check order of DESIGN.md §3: one case per check, in the order applied.

Each case's address fails its own check and every later one, so the reply shows which check
comes first. The same table runs twice: over the wire, through a real client and a real
in-process listener (the order the Handler applies), and against smtpguard.policy.envelope
(the order as a pure rule). Suppression and the recipient-domain lookup (I/O, after the pure
checks) are covered on the wire here and in tests/wire/test_recipient_domains.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import aiosmtplib
import pytest
from prometheus_client.parser import text_string_to_metric_families

from smtpguard import replies
from smtpguard.policy.envelope import Refusal, recipient_refusal, sender_refusal
from smtpguard.replies import Reply
from smtpguard.server import Server
from tests.support import PASSWORD, Upstream, base_config, password_hash, running_guard

LIMIT = 2
FREE_PASSWORD = "free-zone-pass"
ACME_SENDERS = ["billing@acme.example", "@notify.acme.example"]
SUPPRESSED = "gone@example.com"


@dataclass(frozen=True)
class Case:
    verb: Literal["MAIL", "RCPT"]
    user: str
    address: str
    smtputf8: bool
    reply: Reply
    accepted: int = 0
    """Recipients accepted in the transaction before this RCPT."""


MAIL_CASES = [
    # 1. the zone's plan has no send-as: before anything about the address.
    Case("MAIL", "free-app", "jöe%x@nowhere.example", False, replies.send_as_disabled("initech")),
    # 2. non-ASCII without SMTPUTF8: before the syntax (without it, it is not SMTP syntax).
    Case(
        "MAIL",
        "acme-app",
        "jöe%x@nowhere.example",
        False,
        replies.non_ascii_address("sender", "jöe%x@nowhere.example", "MAIL FROM did not declare SMTPUTF8"),
    ),
    # 3. the syntax: before the alias mapping.
    Case(
        "MAIL",
        "acme-app",
        "joe%x@nowhere.example",
        False,
        replies.bad_address("sender", "percent hack and bang paths are not accepted"),
    ),
    # 4. the alias mapping.
    Case(
        "MAIL",
        "acme-app",
        "joe@nowhere.example",
        False,
        replies.sender_not_allowed("joe@nowhere.example", "acme"),
    ),
    # 5. accepted, with SMTPUTF8 on a route not yet known (the relay checks before DATA).
    Case("MAIL", "acme-app", "jöe@notify.acme.example", True, replies.OK_SENDER),
    Case("MAIL", "acme-app", "billing@acme.example", False, replies.OK_SENDER),
]

RCPT_CASES = [
    # 1. the recipient limit: before anything about the address.
    Case(
        "RCPT", "acme-app", "jöe%x@nowhere.example", False, replies.too_many_recipients(LIMIT), accepted=LIMIT
    ),
    # 2. non-ASCII without SMTPUTF8.
    Case(
        "RCPT",
        "acme-app",
        "jöe%x@nowhere.example",
        False,
        replies.non_ascii_address("recipient", "jöe%x@nowhere.example", "MAIL FROM did not declare SMTPUTF8"),
    ),
    # 3. the syntax: before the suppression lookup.
    Case(
        "RCPT",
        "acme-app",
        "gone%x@example.com",
        False,
        replies.bad_address("recipient", "percent hack and bang paths are not accepted"),
    ),
    # 4. the suppression list (a store lookup, after every pure check).
    Case("RCPT", "acme-app", SUPPRESSED, False, replies.suppressed(SUPPRESSED, "acme")),
    # 5. accepted.
    Case("RCPT", "acme-app", "zoë@example.org", True, replies.OK_RECIPIENT),
    Case("RCPT", "acme-app", "customer@example.com", False, replies.OK_RECIPIENT, accepted=LIMIT - 1),
]


def _config(tmp: Path, upstream_port: int) -> dict[str, object]:
    cfg = base_config(tmp, upstream_port, limits__max_recipients=LIMIT)
    zones = cfg["zones"]
    assert isinstance(zones, dict)
    zones["initech"] = {
        "plan": "free",
        "senders": ["@initech.example"],
        "users": [{"username": "free-app", "password_hash": password_hash(FREE_PASSWORD)}],
    }
    return cfg


@pytest.fixture
async def guard(tmp: Path, upstream: Upstream) -> AsyncIterator[Server]:
    cfg = _config(tmp, upstream.port)
    cfg["metrics"] = {"address": "127.0.0.1:0"}
    async with running_guard(cfg) as server:
        await server.store.suppress_add("acme", SUPPRESSED, "bounced", server.clock())
        yield server


async def _rejected_envelopes(metrics_port: int) -> dict[str, float]:
    """smtpguard_submissions_total{decision="rejected:envelope"} per zone, from /metrics."""
    reader, writer = await asyncio.open_connection("127.0.0.1", metrics_port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    assert head.split()[1] == "200", head
    return {
        s.labels["zone"]: s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "smtpguard_submissions_total" and s.labels.get("decision") == "rejected:envelope"
    }


async def _command(client: aiosmtplib.SMTP, line: str) -> Reply:
    # Sent as bytes: aiosmtplib's own address checks would refuse some cases before the wire.
    resp = await client.execute_command(line.encode())
    enhanced, _, text = resp.message.partition(" ")
    return Reply(resp.code, enhanced, text)


async def _wire(port: int, case: Case) -> Reply:
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False, timeout=10)
    await client.connect()
    try:
        await client.login(case.user, FREE_PASSWORD if case.user == "free-app" else PASSWORD)
        utf8 = " SMTPUTF8" if case.smtputf8 else ""
        if case.verb == "MAIL":
            return await _command(client, f"MAIL FROM:<{case.address}>{utf8}")
        assert await _command(client, f"MAIL FROM:<billing@acme.example>{utf8}") == replies.OK_SENDER
        for n in range(case.accepted):
            assert await _command(client, f"RCPT TO:<r{n}@example.com>") == replies.OK_RECIPIENT
        return await _command(client, f"RCPT TO:<{case.address}>")
    finally:
        client.close()


async def test_the_listener_applies_the_checks_in_this_order(guard: Server, upstream: Upstream) -> None:
    got = [await _wire(guard.ports[0], case) for case in MAIL_CASES + RCPT_CASES]
    assert got == [case.reply for case in MAIL_CASES + RCPT_CASES]
    # Every refusal but the recipient limit counts as a rejected envelope: acme's three at
    # MAIL and three at RCPT (the suppressed one too), initech's send-as.
    assert guard.health is not None
    assert await _rejected_envelopes(guard.health.port) == {"acme": 6.0, "initech": 1.0}
    # Envelope checks answer alone: nothing reached the upstream.
    assert upstream.handler.transactions == 0


# --- the same order as a pure rule ------------------------------------------------------------
ZONES = {"acme-app": ("acme", True, ACME_SENDERS), "free-app": ("initech", False, ["@initech.example"])}
"""user → (zone, plan has send-as, aliases), as _config has them."""


def _expected(case: Case) -> Refusal | None:
    if case.reply.ok:
        return None
    return Refusal(case.reply, counted=case.reply != replies.too_many_recipients(LIMIT))


def _pure(case: Case, route: bool | None = None) -> Refusal | None:
    if case.verb == "MAIL":
        zone, send_as, senders = ZONES[case.user]
        return sender_refusal(case.address, zone, send_as, senders, case.smtputf8, route)
    return recipient_refusal(case.address, case.accepted, LIMIT, case.smtputf8, route)


# Cases the wire cannot bring to these checks (aiosmtpd refuses `<>` syntax first), and the
# route's own answer about SMTPUTF8, which a wire case only learns after a relay.
PURE_ONLY = [
    (Case("MAIL", "acme-app", "", False, replies.sender_not_allowed("", "acme")), None),
    (Case("RCPT", "acme-app", "", False, replies.bad_address("recipient", "empty address")), None),
    (
        Case(
            "MAIL",
            "acme-app",
            "jöe@notify.acme.example",
            True,
            replies.non_ascii_address(
                "sender", "jöe@notify.acme.example", "the upstream route does not offer SMTPUTF8"
            ),
        ),
        False,
    ),
    (
        Case(
            "RCPT",
            "acme-app",
            "zoë@example.org",
            True,
            replies.non_ascii_address(
                "recipient", "zoë@example.org", "the upstream route does not offer SMTPUTF8"
            ),
        ),
        False,
    ),
    (Case("RCPT", "acme-app", "zoë@example.org", True, replies.OK_RECIPIENT), True),
]


@pytest.mark.parametrize(
    "case",
    [c for c in MAIL_CASES + RCPT_CASES if c.address != SUPPRESSED],
    ids=lambda c: f"{c.verb}:{c.address or '<>'}:{c.reply.code}",
)
def test_the_pure_rule_gives_the_listeners_reply(case: Case) -> None:
    assert _pure(case) == _expected(case)


@pytest.mark.parametrize(("case", "route"), PURE_ONLY, ids=lambda c: getattr(c, "address", str(c)))
def test_the_pure_rule_beyond_the_wire_cases(case: Case, route: bool | None) -> None:
    assert _pure(case, route) == _expected(case)


def test_the_suppressed_address_passes_every_pure_check() -> None:
    """The suppression list is looked up after the pure checks: the pure rule accepts it."""
    assert recipient_refusal(SUPPRESSED, 0, LIMIT, False, None) is None


def test_only_the_recipient_limit_goes_uncounted() -> None:
    refusals = [_pure(c) for c in MAIL_CASES + RCPT_CASES if c.address != SUPPRESSED]
    uncounted = [r.reply for r in refusals if r is not None and not r.counted]
    assert uncounted == [replies.too_many_recipients(LIMIT)]
    assert sum(r is not None and r.counted for r in refusals) == 4 + 2  # MAIL, RCPT
