"""`event_loop`: which loop `smtpguard serve` runs on, and that it relays the same on each."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import uvloop

from smtpguard.config import ConfigError
from smtpguard.server import loop_factory
from tests.support import GuardProcess, Upstream, base_config, free_port, message, send, write_config


def startup_line(log: Path) -> dict[str, object]:
    for line in log.read_text().splitlines():
        if '"smtpguard started"' in line:
            parsed: dict[str, object] = json.loads(line)
            return parsed
    raise AssertionError(f"no startup line in {log.read_text()[-2000:]}")


@pytest.mark.parametrize(
    ("choice", "expected"), [("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
async def test_serve_runs_on_the_configured_loop_and_relays_once(
    tmp: Path, upstream: Upstream, choice: str, expected: str
) -> None:
    port = free_port()
    cfg = base_config(tmp, upstream.port, event_loop=choice)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    cfg["log"] = {"format": "json", "level": "info"}
    proc = GuardProcess(write_config(tmp / "smtpguard.yaml", cfg), tmp / "guard.log")
    proc.start()
    try:
        await proc.wait_port(port)
        replies = [(await send(port, message("loop:1"))).code for _ in range(3)]
    finally:
        assert await proc.astop() == 0
    assert replies == [250, 250, 250]
    assert upstream.event_keys() == ["loop:1"]
    assert startup_line(tmp / "guard.log")["event_loop"] == expected


def test_uvloop_asked_for_but_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one fault here that cannot be caused for real: uvloop is a test dependency.
    monkeypatch.setitem(sys.modules, "uvloop", None)
    with pytest.raises(ConfigError, match=r"event_loop: uvloop, but the uvloop package is not installed"):
        loop_factory("uvloop")
    assert loop_factory("auto") is asyncio.new_event_loop


def test_auto_prefers_uvloop_when_installed() -> None:
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("asyncio") is asyncio.new_event_loop
