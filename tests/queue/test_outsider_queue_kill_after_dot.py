"""Store-and-forward, one `kill -9` at the worst instant: the delivery worker's final dot
has reached the upstream, which holds its reply. The restarted instance must hold the
event `unknown`, never send it again; the application's
retry of it is answered `451 4.3.0`, and an operator's `resolve --as delivered` ends it.
Counted at the upstream."""

from __future__ import annotations

import asyncio
from pathlib import Path

from smtpguard.cli import main
from smtpguard.store import store_from_url
from tests.support import (
    Behaviour,
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    message,
    send,
    write_config,
)
from tests.support.eventually import eventually


async def test_kill_9_after_the_final_dot_holds_the_event_unknown_and_sends_it_once(
    tmp: Path, upstream: Upstream
) -> None:
    release = asyncio.Event()
    upstream.handler.default = Behaviour(hold_after_dot=release)
    port = free_port()
    cfg = base_config(tmp, upstream.port, zones__acme__delivery="queue")
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    cfg["event_key"] = {"inflight_wait": "200ms", "lease": "1s", "strip": False}
    cfg["queue"] = {"backoff": {"base": "100ms", "max": "500ms"}, "workers": 2, "poll_interval": "50ms"}
    path = write_config(tmp / "c.yaml", cfg)
    proc = GuardProcess(path, tmp / "guard.log")
    store = store_from_url(cfg["store"]["url"])
    try:
        proc.start()
        await proc.wait_port(port)
        queued = await send(port, message("dot:1"))
        assert queued.code == 250 and "queued" in queued.text, queued
        await upstream.wait_received(1)  # the final dot is at the upstream, its reply held
        proc.kill()
        release.set()  # the upstream's 250 now goes to a dead socket
        proc.start()
        await proc.wait_port(port)
        await store.open()
        rec = await eventually(
            lambda: store.get("acme", "dot:1"),
            lambda r: r is not None and r.state.value == "unknown",
            timeout=20,
            interval=0.1,
        )
        retried = await send(port, message("dot:1"))
        # The queue's view: the entry is kept (for an operator) but never due again.
        entries = [e for e in await store.queue_entries("acme") if e.key == "dot:1"]
    finally:
        await proc.astop()
    sent_before_resolve = upstream.event_keys().count("dot:1")
    assert (
        await asyncio.to_thread(main, ["resolve", "acme", "dot:1", "--as", "delivered", "-c", str(path)]) == 0
    )
    after = await store.get("acme", "dot:1")
    await store.close()
    print(
        f"kill after dot: record={rec.state.value if rec else None} retry={retried} "
        f"queue entries={[(e.key, e.due_at) for e in entries]} upstream copies={sent_before_resolve} "
        f"after resolve={after.state.value if after else None}"
    )
    assert retried.code == 451 and retried.text.startswith("4.3.0"), retried
    assert all(e.due_at is None for e in entries)
    assert sent_before_resolve == 1
    assert after is not None and after.state.value == "delivered"
