"""`smtpguard pause ZONE --receiver R` (DESIGN.md §21) on a config where receivers are off (no
top-level `receivers:` and no zone's `receivers:`): serve makes no MX lookup then, so the
pause would be stored, reported as done, and hold nothing. A real serve, a real DNS server
(NSD), a recording upstream: the CLI refuses it as a usage error naming the fix, and mail
that it would have claimed to hold is not silently let through under a "paused"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from smtpguard.cli import main
from tests.support import Upstream, base_config, message, running_guard, send
from tests.support.dns import NsdServer

RECORDS = ["gm IN MX 5 aspmx.l.google.com."]


async def test_a_receiver_pause_with_receivers_off_is_refused(
    tmp: Path, upstream: Upstream, dns_server: NsdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, upstream.port)
    cfg["dns"] = {"nameservers": [dns_server.nameserver], "timeout": "2s"}
    path = tmp / "smtpguard.yaml"
    async with running_guard(cfg, config_path=path) as guard:
        code = await asyncio.to_thread(main, ["pause", "acme", "--receiver", "gmail", "-c", str(path)])
        out = capsys.readouterr()
        print("pause:", code, out.out, out.err)
        assert code == 2, out
        assert "receivers" in out.err and "paused" not in out.out
        assert guard.store is not None and await guard.store.paused_classes() == set()
        # resume is not refused: it only ever lets mail go (a pause stored before).
        assert await asyncio.to_thread(main, ["resume", "acme", "--receiver", "gmail", "-c", str(path)]) == 0
        reply = await send(guard.ports[0], message("k1"), recipients=["a@gm.test"])
        assert reply.code == 250
        await upstream.wait_received(1)
