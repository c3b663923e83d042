"""The least-privilege Redis user of docs/redis.md (DESIGN.md §18) serving a store-and-
forward zone: acceptance, the worker's claims, holds under a pause, its
deliveries, the hourly purge, the queue listing and the operator's queue commands all run
as that user; Redis' ACL LOG records no refused command, and the upstream has each event
once."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from pathlib import Path

import redis

from smtpguard.cli import main
from tests.store.test_redis_acl import documented_acl
from tests.support import RedisServer, Upstream, base_config, message, running_guard, send, write_config
from tests.support.eventually import eventually


async def test_queue_mode_works_with_exactly_the_documented_acl(tmp: Path, upstream: Upstream) -> None:
    server = RedisServer(tmp / "redis", durable=True)
    server.tmp.mkdir()
    server.start()
    password = secrets.token_urlsafe(24)
    admin = redis.Redis(port=server.port, decode_responses=True)
    try:
        assert (
            admin.execute_command("ACL", "SETUSER", "smtpguard", "reset", f">{password}", *documented_acl())
            == "OK"
        )
        (tmp / "redis.password").write_text(password + "\n")
        cfg = base_config(
            tmp,
            upstream.port,
            store={
                "url": f"redis://smtpguard@127.0.0.1:{server.port}/0",
                "password_file": str(tmp / "redis.password"),
            },
            zones__acme__delivery="queue",
            zones__acme__hourly_cap=100_000,
            zones__acme__monthly_cap=1_000_000,
        )
        cfg["queue"] = {"backoff": {"base": "100ms", "max": "500ms"}, "poll_interval": "50ms"}
        path = write_config(tmp / "c.yaml", cfg)
        async with running_guard(cfg) as guard:
            store = guard.store
            assert store is not None
            port = guard.ports[0]
            await store.set_paused("acme", True)
            held = await asyncio.gather(*(send(port, message(f"aclq:{i}")) for i in range(5)))
            listed = await asyncio.to_thread(main, ["queue", "list", "acme", "-c", str(path)])
            await store.set_paused("acme", False)
            for i in range(5):
                await eventually(
                    lambda i=i: store.get("acme", f"aclq:{i}"),
                    lambda r: r is not None and r.state.value == "delivered",
                    timeout=20,
                    interval=0.05,
                )
            dups = await asyncio.gather(*(send(port, message(f"aclq:{i}")) for i in range(5)))
            await store.purge(store.now(), 30 * 86400.0)
        refused = [f"{e['reason']} {e['object']}" for e in admin.acl_log() if e["username"] == "smtpguard"]
    finally:
        admin.close()
        server.stop()
    counts = Counter(upstream.event_keys())
    print(f"queue mode with the documented ACL: upstream {dict(counts)}, refused {refused}")
    assert [r.code for r in held] == [250] * 5
    assert listed == 0
    assert all(d.code == 250 and "duplicate" in d.text for d in dups)
    assert counts == Counter(f"aclq:{i}" for i in range(5))
    assert refused == []
