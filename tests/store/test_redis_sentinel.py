"""Redis with Sentinel under a submission storm (DESIGN.md §15), counted at the upstream.

A master, two replicas and three sentinels (`redis-server --sentinel`, quorum 2) on
loopback ports; one `smtpguard serve` finds the master through
`redis+sentinel://…/sg/0`. Mid-storm the master is killed with `kill -9`; the sentinels
promote a replica and smtpguard follows it without a restart. Run without and with
`store.wait` (WAIT for one replica after each ledger write); counted both ways:
duplicates at the upstream after every accepted event is submitted again, lost client 250s,
and the keys held. Two replicas, so that with store.wait the promoted master still has one
to wait for.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
import redis

from smtpguard.config import loads
from tests.support import (
    Behaviour,
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    wait_listening,
    write_config,
)
from tests.support.failover import storm

pytestmark = pytest.mark.slow


class Node:
    def __init__(self, tmp: Path, name: str, *args: str, sentinel: bool = False) -> None:
        self.port = free_port()
        self.dir = tmp / name
        self.dir.mkdir()
        if sentinel:
            conf = self.dir / "sentinel.conf"
            conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n" + "\n".join(args) + "\n")
            argv = ["redis-server", str(conf), "--sentinel"]
        else:
            argv = [
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "yes", "--appendfsync", "always", *args,
            ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.port, name)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


def replicas_online(port: int) -> int:
    r = redis.Redis(port=port, socket_timeout=1)
    try:
        info = r.info("replication")
        return sum(1 for k, v in info.items() if k.startswith("slave") and v.get("state") == "online")
    finally:
        r.close()


@pytest.mark.parametrize("wait", [False, True], ids=["no-wait", "wait-1-replica"])
async def test_master_killed_mid_storm_sentinel_promotes_a_replica(
    tmp: Path, upstream: Upstream, wait: bool
) -> None:
    started = time.monotonic()
    upstream.handler.default = Behaviour(hang_after_dot=0.05)
    nodes: list[Node] = []
    guard: GuardProcess | None = None
    try:
        master = Node(tmp, "master")
        nodes.append(master)
        for i in range(2):
            nodes.append(Node(tmp, f"replica{i}", "--replicaof", "127.0.0.1", str(master.port)))
        deadline = time.monotonic() + 10
        while replicas_online(master.port) < 2:
            assert time.monotonic() < deadline, "replicas did not sync"
            await asyncio.sleep(0.1)
        sentinels = [
            Node(
                tmp,
                f"sentinel{i}",
                f"sentinel monitor sg 127.0.0.1 {master.port} 2",
                "sentinel down-after-milliseconds sg 500",
                "sentinel failover-timeout sg 5000",
                "sentinel parallel-syncs sg 2",
                sentinel=True,
            )
            for i in range(3)
        ]
        nodes += sentinels
        url = "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in sentinels) + "/sg/0"
        port = free_port()
        cfg = base_config(tmp, upstream.port, instance="a", store__url=url)
        if wait:
            cfg["store"]["wait"] = {"replicas": 1, "timeout": "500ms"}
        cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
        cfg["event_key"] = {"inflight_wait": "1s", "min_retry_interval": "1s", "lease": "4s", "strip": False}
        cfg["zones"]["acme"].update(plan="unlimited", hourly_cap=1_000_000, monthly_cap=1_000_000)
        path = write_config(tmp / "a.yaml", cfg)
        assert loads(path.read_text()).store.url == url
        guard = GuardProcess(path, tmp / "a.log")
        guard.start()
        await guard.wait_port(port)

        promoted: dict[str, float] = {}

        async def fail_over() -> None:
            killed = time.monotonic()
            await asyncio.to_thread(master.kill)
            probe = redis.Redis(port=sentinels[0].port, socket_timeout=1)
            try:
                while True:
                    addr = probe.sentinel_get_master_addr_by_name("sg")
                    if addr and int(addr[1]) != master.port:
                        promoted["after"] = time.monotonic() - killed
                        return
                    assert time.monotonic() - killed < 20, "sentinel did not fail over"
                    await asyncio.sleep(0.05)
            finally:
                probe.close()

        count = await storm(port, upstream, fail_over, settle=10.0, prefix=f"sent{int(wait)}")
        print(
            f"redis sentinel failover, store.wait {'1 replica' if wait else 'off'}: master killed -9, "
            f"promoted by sentinel {promoted.get('after', float('nan')):.2f} s later; {count.summary()}; "
            f"test ran {time.monotonic() - started:.1f} s"
        )
        assert count.first_250_after is not None, "no session reached the new master"
        assert count.lost == []
        if wait:
            # Every ledger write had reached a replica before any upstream byte; the promoted
            # one (the sentinels pick the most up to date) holds them all.
            assert count.duplicates == {}
    except BaseException:
        if guard is not None:
            print(f"--- a.log ---\n{guard.log_path.read_text()[-3000:]}")
        raise
    finally:
        if guard is not None:
            await asyncio.to_thread(guard.stop)
        for node in reversed(nodes):
            node.stop()
