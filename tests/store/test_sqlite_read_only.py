"""A SQLite store this process may not write (DESIGN.md §18): on a read-only mount (systemd
ProtectSystem=strict with the store outside ReadWritePaths, a disk remounted read-only)
`serve` exits 1 naming the file and the reason, rather than start, tell systemd READY,
answer /readyz 200 and every submission 451 4.3.0; and /readyz answers 503 with the reason
while the file system under a running store is read-only.

Real read-only bind mounts, in a mount namespace of serve's own (`unshare -m`; the host's
mounts are never touched). The CI runs as root: without `unshare` or the right to use it,
these tests fail, they do not skip."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from smtpguard.store import store_from_url
from tests.ops.test_ops import http_get
from tests.support import GuardProcess, Upstream, base_config, free_port, message, send, write_config


def _namespace_tools() -> None:
    missing = [tool for tool in ("unshare", "nsenter", "mount", "umount") if shutil.which(tool) is None]
    assert not missing, f"these tests need {missing} (util-linux) and root; they do not skip"


def _config(tmp: Path, db: Path, upstream: Upstream) -> tuple[Path, int, int]:
    smtp, health = free_port(), free_port()
    cfg = base_config(tmp, upstream.port, store__url=f"sqlite:///{db}")
    cfg["listen"] = [{"address": f"127.0.0.1:{smtp}", "tls": "none"}]
    cfg["metrics"] = {"address": f"127.0.0.1:{health}"}
    return write_config(tmp / "c.yaml", cfg), smtp, health


async def _create(db: Path) -> None:
    store = store_from_url(f"sqlite:///{db}")
    await store.open()
    await store.close()


def _read_only_mount(folder: Path) -> tuple[str, ...]:
    """serve in a mount namespace of its own, where `folder` is bind-mounted read-only."""
    return ("unshare", "-m", "sh", "-c", f"mount --bind -o ro '{folder}' '{folder}' && exec \"$@\"", "sh")


async def _exit_of(guard: GuardProcess, timeout: float = 20) -> int:
    assert guard.proc is not None
    deadline = time.monotonic() + timeout
    while (rc := guard.proc.poll()) is None:
        assert time.monotonic() < deadline, "serve kept running on a read-only store"
        await asyncio.sleep(0.05)
    return rc


@pytest.mark.parametrize("existing", [True, False], ids=["an existing store", "no file yet"])
async def test_serve_refuses_a_store_on_a_read_only_mount(
    tmp: Path, upstream: Upstream, existing: bool
) -> None:
    _namespace_tools()
    folder = tmp / "db"
    folder.mkdir()
    db = folder / "state.db"
    if existing:
        await _create(db)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    config, _, _ = _config(tmp, db, upstream)
    guard = GuardProcess(config, tmp / "log", prefix=_read_only_mount(folder))
    guard.start()
    try:
        rc = await _exit_of(guard)
    finally:
        guard.kill()
    log = (tmp / "log").read_text()
    print(f"exit {rc}: {log.strip()[-400:]}")
    assert rc == 1
    where = db if existing else folder
    assert f"smtpguard: store: cannot write {db}: {where} is on a read-only file system" in log
    assert "smtpguard started" not in log
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


async def test_readyz_is_503_while_the_store_is_on_a_read_only_file_system(
    tmp: Path, upstream: Upstream
) -> None:
    """The file system under a running store turns read-only (a bind mount over its folder,
    made inside serve's namespace after it started: what a remount after an I/O error
    looks like to the next path lookup); /readyz says so, and is 200 again once it is
    writable."""
    _namespace_tools()
    folder = tmp / "db"
    folder.mkdir()
    db = folder / "state.db"
    config, smtp, health = _config(tmp, db, upstream)
    guard = GuardProcess(config, tmp / "log", prefix=("unshare", "-m"))
    guard.start()
    try:
        await guard.wait_port(health)
        assert guard.proc is not None
        assert (await send(smtp, message("rw:1"))).code == 250
        assert await http_get(health, "/readyz") == (200, "ready\n")
        ns = ("nsenter", "-t", str(guard.proc.pid), "-m")
        read_only = [*ns, "mount", "--bind", "-o", "ro", str(folder), str(folder)]
        await asyncio.to_thread(subprocess.run, read_only, check=True)
        unready = await http_get(health, "/readyz")
        await asyncio.to_thread(subprocess.run, [*ns, "umount", str(folder)], check=True)
        again = await http_get(health, "/readyz")
    finally:
        rc = await guard.astop()
    print(f"read-only: {unready}; writable again: {again}; exit {rc}")
    assert unready == (503, f"store refuses writes: {db} is on a read-only file system\n")
    assert again == (200, "ready\n")
