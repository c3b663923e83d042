"""A recipient domain spelt to dodge a paused receiver (DESIGN.md §21): upper case, a
trailing dot, both, an IDN written in Unicode or in punycode (with SMTPUTF8), an MX host
written in capitals. A real DNS server (NSD) serves the MX records, a real listener and
client, a recording upstream: while `gmail` is paused, no spelling of a gmail-hosted domain
is taken at RCPT — each is held (`451 4.7.1`) or refused as no address (`501 5.1.3`: a
trailing dot, an IDN in capitals that IDNA 2008 does not map) — and nothing reaches the
upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support import base_config, running_guard
from tests.support.dns import NsdServer
from tests.support.utf8 import Utf8Upstream, raw_message, transact, utf8_upstream

RECORDS = [
    "gm IN MX 5 aspmx.l.google.com.",
    "xn--bcher-kva IN MX 5 aspmx.l.google.com.",  # bücher.test
    "up IN MX 5 ASPMX.L.GOOGLE.COM.",
    "plain IN MX 10 mx.hosting.example.",
]

SPELLINGS = [
    "a@gm.test",
    "a@GM.TEST",
    "a@gm.test.",
    "a@Gm.Test.",
    "a@up.test",
    "a@xn--bcher-kva.test",
    "a@XN--BCHER-KVA.TEST.",
    "a@bücher.test",
    "a@BÜCHER.test",
    "a@bücher.test.",
]


@pytest.fixture
async def up() -> AsyncIterator[Utf8Upstream]:
    async with utf8_upstream() as u:
        yield u


async def test_every_spelling_of_a_paused_receivers_domain_is_held(
    tmp: Path, up: Utf8Upstream, dns_server: NsdServer
) -> None:
    cfg = base_config(tmp, up.port)
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    cfg["receivers"] = {}
    cfg["zones"]["acme"]["receivers"] = {"gmail": {"paused": True}}
    answers: dict[str, str] = {}
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        # A warm-up recipient of no receiver, so the provider's SMTPUTF8 is known.
        warm = await transact(
            port, "billing@acme.example", ["w@plain.test"], raw_message("warm"), smtputf8=True
        )
        assert warm.data is not None and warm.data.code == 250, warm
        for i, rcpt in enumerate(SPELLINGS):
            t = await transact(port, "billing@acme.example", [rcpt], raw_message(f"sp:{i}"), smtputf8=True)
            answers[rcpt] = str(t.rcpts[0]) if t.rcpts else str(t.mail)
    print("spellings:", answers, "upstream:", [r.rcpt_tos for r in up.received])
    dodged = {r: a for r, a in answers.items() if not a.startswith(("451 4.7.1", "501 5.1.3"))}
    assert dodged == {}
    held = [r for r, a in answers.items() if a.startswith("451 4.7.1")]
    assert set(held) >= {"a@gm.test", "a@GM.TEST", "a@up.test", "a@xn--bcher-kva.test", "a@bücher.test"}
    assert [r.rcpt_tos for r in up.received] == [["w@plain.test"]]
