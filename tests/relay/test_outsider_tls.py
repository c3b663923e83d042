"""A provider configured `tls: starttls` whose server does not offer STARTTLS (stripped by
a man in the middle, or misconfigured): nothing is written in clear, neither AUTH nor the
message, and since nothing was sent the standby may take the event. Counted on the wire:
the primary is the scripted server of tests/relay/test_wire_attacks.py, which records
every command line; the standby is the recording upstream."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.relay.test_resilience import routed, smtp_provider, upstream_on
from tests.relay.test_wire_attacks import Scripted
from tests.support import message, running_guard, send

pytestmark = pytest.mark.usefixtures("no_tracebacks")

SECRET = "provider-secret-XYZ"


async def test_a_stripped_starttls_sends_nothing_in_clear_and_fails_over(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRIMARY_PASSWORD", SECRET)
    async with Scripted() as primary, upstream_on() as standby:
        cfg = routed(
            tmp,
            smtp_provider(
                "primary", primary.port, tls="starttls", username="relay", password_env="PRIMARY_PASSWORD"
            ),
            smtp_provider("standby", standby.port),
        )
        async with running_guard(cfg) as guard:
            first = await send(guard.ports[0], message("tls:1"))
            again = await send(guard.ports[0], message("tls:1"))
    assert first.code == 250 and "duplicate" not in first.text, first
    assert again.code == 250 and "duplicate" in again.text, again
    assert standby.event_keys() == ["tls:1"]
    # The primary heard a greeting and nothing else: no AUTH, no MAIL, no message.
    assert primary.commands and all(c.startswith(b"EHLO") for c in primary.commands), primary.commands
    assert primary.messages == []
    wire = b"".join(primary.chunks)
    assert SECRET.encode() not in wire and base64.b64encode(SECRET.encode()) not in wire
