"""The least-privilege Redis user that docs/redis.md recommends (DESIGN.md §18): `serve`
and the operator commands work with exactly that ACL, read from the doc itself so the doc
and this test cannot drift apart. A real redis-server that fsyncs every write (so the
durability check at start passes without `store.unsafe`), a real SMTP client, a recording
upstream that counts what it received, and Redis' own ACL LOG, which counts every command
the user was refused."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from smtpguard.cli import main
from tests.support import (
    GuardProcess,
    RedisServer,
    Upstream,
    base_config,
    free_port,
    message,
    send,
    write_config,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "redis.md"


def documented_acl() -> list[str]:
    """The rules of the `ACL SETUSER smtpguard …` line in docs/redis.md, password excluded."""
    lines = [ln.strip() for ln in DOC.read_text().splitlines() if ln.strip().startswith("ACL SETUSER ")]
    assert len(lines) == 1, f"docs/redis.md should show one ACL SETUSER line, has {lines}"
    words = lines[0].split()
    assert words[2] == "smtpguard"
    rules = words[3:]
    assert [r for r in rules if r.startswith(">")] == [">LONG-RANDOM-PASSWORD"], rules
    return [r for r in rules if not r.startswith(">")]


@pytest.fixture
def durable_redis(tmp: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp / "redis", durable=True)
    server.tmp.mkdir()
    server.start()
    yield server
    server.stop()


def _serve_config(tmp: Path, upstream: Upstream, server: RedisServer, password: str) -> tuple[Path, int]:
    (tmp / "redis.password").write_text(password + "\n")
    port = free_port()
    cfg = base_config(
        tmp,
        upstream.port,
        store__url=f"redis://smtpguard@127.0.0.1:{server.port}/0",
        store__password_file=str(tmp / "redis.password"),
    )
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    return write_config(tmp / "c.yaml", cfg), port


def _refusals(admin: redis.Redis) -> list[str]:
    return [f"{e['reason']} {e['object']}" for e in admin.acl_log() if e["username"] == "smtpguard"]


@pytest.mark.slow
async def test_serve_and_the_cli_work_with_exactly_the_documented_acl(
    tmp: Path, upstream: Upstream, durable_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = documented_acl()
    password = secrets.token_urlsafe(24)
    admin = redis.Redis(port=durable_redis.port, decode_responses=True)
    assert admin.execute_command("ACL", "SETUSER", "smtpguard", "reset", f">{password}", *rules) == "OK"
    path, port = _serve_config(tmp, upstream, durable_redis, password)
    guard = GuardProcess(path, tmp / "guard.log")
    guard.start()
    try:
        await guard.wait_port(port)
        distinct = await asyncio.gather(*(send(port, message(f"acl:{i}")) for i in range(10)))
        storm = await asyncio.gather(*(send(port, message("acl:storm")) for _ in range(5)))
        # The operator commands the doc names, as the same user (in this process; each runs
        # its own event loop, so off this one).
        cli = [
            await asyncio.to_thread(main, [*argv, "-c", str(path)])
            for argv in (
                ["history", "acme", "acl:0", "--json"],
                ["stats", "acme", "--json"],
                ["pause", "acme"],
                ["resume", "acme"],
                ["suppress", "add", "acme", "gone@example.com"],
                ["suppress", "list", "acme", "--json"],
            )
        ]
        out = capsys.readouterr().out
    finally:
        rc = await guard.astop(timeout=30)
    refused = _refusals(admin)
    log = (tmp / "guard.log").read_text()
    admin.close()
    counts = Counter(upstream.event_keys())
    print(f"documented ACL {' '.join(rules)}: upstream {dict(counts)}; refused {refused}")
    assert [r.code for r in distinct] == [250] * 10
    assert [r.code for r in storm] == [250] * 5 and sum("duplicate" in r.text for r in storm) == 4
    assert cli == [0] * 6
    assert '"state":"delivered"' in out.replace(" ", "")
    assert "gone@example.com" in out
    assert counts == Counter([*(f"acl:{i}" for i in range(10)), "acl:storm"])
    assert refused == []
    assert "NOPERM" not in log and "Traceback" not in log
    assert rc == 0


@pytest.mark.slow
async def test_without_config_get_serve_refuses_and_names_the_rule(
    tmp: Path, upstream: Upstream, durable_redis: RedisServer
) -> None:
    """The durability check is the store's promise (DESIGN.md §15): a user that may not read
    it gets a refusal that says what to grant, not a silent pass."""
    rules = [r for r in documented_acl() if r != "+config|get"]
    password = secrets.token_urlsafe(24)
    admin = redis.Redis(port=durable_redis.port, decode_responses=True)
    admin.execute_command("ACL", "SETUSER", "smtpguard", "reset", f">{password}", *rules)
    admin.close()
    path, _ = _serve_config(tmp, upstream, durable_redis, password)
    guard = GuardProcess(path, tmp / "guard.log")
    guard.start()
    assert guard.proc is not None
    code = await asyncio.to_thread(guard.proc.wait, 30)
    guard.stop()
    text = (tmp / "guard.log").read_text()
    assert code == 1
    says = r"CONFIG GET is refused .*grant the store's Redis user \+config\|get"
    assert re.search(says, text), text[-2000:]
    assert "Traceback" not in text
    assert upstream.received == []
