"""Running `smtpguard …` in a test: main() in a thread (it runs its own event loop), its exit
code and its output, decoded when it is a --json document."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from smtpguard.cli import main


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = await asyncio.to_thread(main, list(argv))
    out = capsys.readouterr().out
    try:
        return code, json.loads(out)
    except ValueError:
        return code, out
