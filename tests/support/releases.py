"""An earlier release's package, for the tests of upgrades with it still serving."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.support import GuardProcess, free_port, write_config

ROOT = Path(__file__).resolve().parents[2]


def extract_release(commit: str, dest: Path) -> Path:
    """`smtpguard/` as `commit` had it, under `dest` (made if missing), from `git archive`:
    run with this checkout's interpreter and `dest` first on the path, it is that release's
    `serve` and CLI."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "smtpguard"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


async def release_cli(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI of the release at `tree`, off the event loop: a fake API or upstream it asks
    may be running on that loop."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "smtpguard", *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@contextlib.asynccontextmanager
async def release_serving(tree: Path, cfg: dict[str, Any], tmp: Path) -> AsyncIterator[int]:
    """`serve` of the release at `tree` in a process of its own for as long as the block
    runs, on `cfg` (written to tmp/old.yaml, its output to tmp/old.log) listening on a port
    of its own: that port, once it answers."""
    port = free_port()
    cfg = {**cfg, "listen": [{"address": f"127.0.0.1:{port}", "tls": "none"}]}
    old = GuardProcess(write_config(tmp / "old.yaml", cfg), tmp / "old.log", src=tree)
    old.start()
    try:
        await old.wait_port(port, timeout=30)
        yield port
    finally:
        await old.astop()
