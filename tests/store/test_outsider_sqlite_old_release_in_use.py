"""An operator upgrades the package while the earlier release's `serve` still has the SQLite
file open, and runs this release's CLI against it before restarting: the CLI's first write
migrates the file under the running daemon. The earlier release keeps serving on the
migrated file — the pause and the suppression the new CLI wrote hold, a delivered event is
still a duplicate — and this release, started on the file afterwards, knows every event the
earlier one sent. Counted at the upstream: each event once. The earlier releases' own code
(their trees from `git archive`) runs as a real `serve` process."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from smtpguard.store.sqlite.migrate import LATEST
from tests.support import (
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.releases import ROOT, extract_release

RELEASES = {"44f68cc": 0, "a89d5c7": 2}
"""Commit → the SQLite user_version its `serve` leaves: the last release before numbered
migrations, and the last before migration 3."""


@pytest.fixture(params=sorted(RELEASES))
def release(request: pytest.FixtureRequest) -> Iterator[tuple[Path, int]]:
    commit = str(request.param)
    with tempfile.TemporaryDirectory(prefix="smtpguard-release-") as tmp:
        yield extract_release(commit, Path(tmp)), RELEASES[commit]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smtpguard", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def _version(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


async def test_this_releases_cli_migrates_a_file_the_earlier_serve_keeps_serving(
    tmp: Path, upstream: Upstream, release: tuple[Path, int]
) -> None:
    tree, version = release
    port = free_port()
    cfg = base_config(tmp, upstream.port)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    path = write_config(tmp / "smtpguard.yaml", cfg)
    blocked = "blocked@example.com"
    old = GuardProcess(path, tmp / "old.log", src=tree)
    old.start()
    try:
        await old.wait_port(port)
        assert (await send(port, message("old:1"))).code == 250
        assert _version(tmp / "state.db") == version
        paused = await asyncio.to_thread(_cli, "pause", "-c", str(path), "acme")
        suppressed = await asyncio.to_thread(_cli, "suppress", "add", "-c", str(path), "acme", blocked)
        assert paused.returncode == 0 and suppressed.returncode == 0, (paused, suppressed)
        assert _version(tmp / "state.db") == LATEST
        await asyncio.sleep(1.2)  # the earlier release reads pause flags at most a second old
        held = await send(port, message("old:2"))
        assert held.code == 451 and "paused" in held.text, held
        dup = await send(port, message("old:1"))
        assert dup.code == 250 and "duplicate" in dup.text, dup
        assert (await asyncio.to_thread(_cli, "resume", "-c", str(path), "acme")).returncode == 0
        await asyncio.sleep(1.2)
        assert (await send(port, message("old:2"))).code == 250
        refused = await send(port, message("old:3", to=blocked), recipients=[blocked])
        assert refused.code == 550 and "5.1.1" in refused.text, refused
    finally:
        assert await old.astop() == 0
    assert "Traceback" not in (tmp / "old.log").read_text()
    async with running_guard(cfg) as guard:
        for key in ("old:1", "old:2"):
            again = await send(guard.ports[0], message(key))
            assert again.code == 250 and "duplicate" in again.text, again
    assert upstream.event_keys() == ["old:1", "old:2"]
