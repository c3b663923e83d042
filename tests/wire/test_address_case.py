"""Address case, end to end: Unicode case mapping must not make a sender a mapped alias, and
suppression matches an address whatever the case its local part is written in.

A real client, the in-process smtpguard, the recording upstream (with and without
SMTPUTF8), a real SQLite file and the real redis-server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import nothing_recorded
from tests.support.utf8 import Utf8Upstream, cap_usage, raw_message, store_overrides, transact, utf8_upstream

KELVIN = "\u212a"  # KELVIN SIGN: str.lower() makes it "k"
SENDERS = ["billing@acme.example", "@bank.example", "kelvin@trust.example"]


@pytest.fixture
async def utf8_up() -> AsyncIterator[Utf8Upstream]:
    async with utf8_upstream() as up:
        yield up


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    yield from store_overrides(request, tmp, redis_db=7)


async def test_kelvin_sign_domain_is_not_the_mapped_domain_without_smtputf8(
    tmp: Path, upstream: Upstream, no_tracebacks: None
) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__senders=SENDERS)
    async with running_guard(cfg) as guard:
        t = await transact(guard.ports[0], f"x@ban{KELVIN}.example", ["c@example.com"], raw_message("kv1"))
        untouched = await nothing_recorded(guard, "acme", "kv1")
    # Not ASCII, no SMTPUTF8: refused as such, never judged as x@bank.example.
    assert str(t.mail).startswith("553 5.6.7 ") and t.rcpts == []
    assert untouched and upstream.handler.transactions == 0


async def test_kelvin_sign_is_refused_with_smtputf8_too(
    tmp: Path, utf8_up: Utf8Upstream, no_tracebacks: None
) -> None:
    cfg = base_config(tmp, utf8_up.port, zones__acme__senders=SENDERS)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        # A plain message first: the listener learns that the provider offers SMTPUTF8.
        plain = await transact(port, "billing@acme.example", ["c@example.com"], raw_message("kv0"))
        domain = await transact(
            port, f"x@ban{KELVIN}.example", ["c@example.com"], raw_message("kv2"), smtputf8=True
        )
        local = await transact(
            port, f"{KELVIN}elvin@trust.example", ["c@example.com"], raw_message("kv3"), smtputf8=True
        )
        # The header From is judged the same way (the envelope sender is mapped).
        header = await transact(
            port,
            "billing@acme.example",
            ["c@example.com"],
            raw_message("kv4", sender=f"x@ban{KELVIN}.example"),
            smtputf8=True,
        )
        usage = await cap_usage(guard)
        assert guard.store is not None
        records = [await guard.store.get("acme", k) for k in ("kv2", "kv3", "kv4")]

    assert plain.data is not None and plain.data.code == 250
    # U+212A is no letter a domain may hold (IDNA 2008): a bad domain, not bank.example.
    assert str(domain.mail).startswith("501 5.1.7 ") and "bad domain" in domain.mail.text
    # A non-ASCII local part matches only itself: not the alias kelvin@trust.example.
    assert str(local.mail).startswith("550 5.7.1 ") and "not a mapped alias" in local.mail.text
    assert header.data is not None and str(header.data).startswith("550 5.6.0 ")
    assert "From" in header.data.text
    # Only the plain message went out; the refused ones reserved nothing and spent nothing.
    assert len(utf8_up.received) == 1 and utf8_up.handler.transactions == 1
    assert records == [None, None, None] and (usage.hour, usage.month) == (1, 1)


async def test_mapped_ascii_senders_still_match_in_any_case(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__senders=SENDERS)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        replies = [
            await transact(port, sender, ["c@example.com"], raw_message(f"ok{i}"))
            for i, sender in enumerate(["x@BANK.example", "KELVIN@Trust.Example", "Billing@ACME.example"])
        ]
    for t in replies:
        assert t.mail.code == 250 and t.data is not None and t.data.code == 250, t
    assert [r.mail_from for r in upstream.received] == [
        "x@BANK.example",
        "KELVIN@Trust.Example",
        "Billing@ACME.example",
    ]


async def test_suppression_matches_whatever_the_case_of_the_local_part(
    tmp: Path, utf8_up: Utf8Upstream, store: dict[str, Any], no_tracebacks: None
) -> None:
    cfg = base_config(tmp, utf8_up.port, **store)
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        # Stored through the real store as written: what a bounce, a complaint or
        # `smtpguard suppress add` left there before local parts were folded.
        await guard.store.suppress_add("acme", "Bob@Example.com", "bounced", guard.clock())
        await guard.store.suppress_add("acme", "erin@example.com", "complained", guard.clock())
        await guard.store.suppress_add("global", "Carol@Spam.Example", "complaint", guard.clock())
        await guard.store.suppress_add("acme", "jöe@example.net", "bounced", guard.clock())
        t = await transact(
            guard.ports[0],
            "billing@acme.example",
            [
                "bob@example.com",
                "BOB@EXAMPLE.COM",
                "Erin@Example.com",
                "carol@spam.example",
                "Dave@Example.com",
            ],
            raw_message("s1"),
        )
        utf8 = await transact(
            guard.ports[0],
            "billing@acme.example",
            ["JÖE@example.net", "dave@example.com"],
            raw_message("s2"),
            smtputf8=True,
        )
        usage = await cap_usage(guard)

    assert [a.code for a in t.rcpts] == [550, 550, 550, 550, 250]
    for answer, listname in zip(t.rcpts[:4], ["acme", "acme", "acme", "global"], strict=True):
        assert answer.enhanced == "5.1.1" and f"on the {listname} suppression list" in answer.text
    assert t.data is not None and t.data.code == 250
    # Non-ASCII local parts fold too.
    assert [a.code for a in utf8.rcpts] == [550, 250] and utf8.rcpts[0].enhanced == "5.1.1"
    assert utf8.data is not None and utf8.data.code == 250
    # What was left went out with its local part as written (only the domain is lowered).
    assert [r.rcpt_tos for r in utf8_up.received] == [["Dave@example.com"], ["dave@example.com"]]
    assert (usage.hour, usage.month) == (2, 2)
