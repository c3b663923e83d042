"""`workers: N` (DESIGN.md §17): a supervisor and N `smtpguard serve` workers on one set of
listening sockets, on every store. Real processes, a real SMTP client, a recording upstream
that counts what it received; the store is a real SQLite file, redis-server or PostgreSQL.

The fast tests drive the shared connection table (two workers' views of one mapped file)
and the restart policy; the slow ones run `smtpguard serve` with `workers: 2`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosmtplib
import pytest
import redis

from smtpguard.config import ConfigError, loads, worker_count
from smtpguard.connection_table import ConnectionTable, address_key
from smtpguard.policy.restart import MAX_DELAY, STABLE_AFTER, after_exit
from smtpguard.server import Server
from smtpguard.workers import REUSEPORT, WorkerRole, bound_socket
from tests.support import (
    OTHER_PASSWORD,
    PASSWORD,
    Behaviour,
    GuardProcess,
    RedisServer,
    Reply,
    Upstream,
    base_config,
    free_port,
    message,
    send,
    write_config,
)
from tests.support.eventually import eventually
from tests.support.postgres import PostgresServer
from tests.wire.test_hostile_auth import attempt, plain

REDIS_DB = 11


# --- the shared connection table --------------------------------------------------------------
def test_connection_limits_are_counted_once_for_every_worker(tmp: Path) -> None:
    path = tmp / "connections"
    ConnectionTable.sized_for(path, workers=2, max_connections=10, create=True).close()
    a, b = ConnectionTable.attach(path, 2), ConnectionTable.attach(path, 2)
    one, two = address_key("192.0.2.1"), address_key("192.0.2.2")
    # Per IP: 3 from one address, whichever worker accepted them.
    assert [a.admit(0, one, 5, 3), b.admit(1, one, 5, 3), a.admit(0, one, 5, 3)] == [True] * 3
    assert not b.admit(1, one, 5, 3)
    # In all: 5, though each worker has seen fewer.
    assert [b.admit(1, two, 5, 3), a.admit(0, two, 5, 3)] == [True, True]
    assert not b.admit(1, address_key("192.0.2.3"), 5, 3)
    assert a.open_connections() == 5
    b.release(1, one)
    assert b.admit(1, one, 5, 3)
    # Worker 1 dies: its connections died with it; worker 0's stay counted.
    a.forget_worker(1)
    assert (b.open_connections(), b.count(one), b.count(two)) == (3, 2, 1)
    a.close()
    b.close()


def test_connection_table_matches_a_plain_count_under_collisions(tmp: Path) -> None:
    """Few slots, many addresses, random admits and releases by three workers: every count
    the table gives equals the obvious one (backward-shift deletion keeps lookups exact)."""
    table = ConnectionTable(tmp / "c", workers=3, slots=64, create=True)
    rng = random.Random(19)
    held: list[tuple[int, str]] = []
    model: Counter[str] = Counter()
    for _ in range(4000):
        if held and rng.random() < 0.5:
            worker, ip = held.pop(rng.randrange(len(held)))
            table.release(worker, address_key(ip))
            model[ip] -= 1
        else:
            worker, ip = rng.randrange(3), f"10.0.0.{rng.randrange(40)}"
            ok = table.admit(worker, address_key(ip), 30, 2)
            assert ok == (sum(model.values()) < 30 and model[ip] < 2)
            if ok:
                held.append((worker, ip))
                model[ip] += 1
        assert table.open_connections() == sum(model.values())
    for i in range(40):
        assert table.count(address_key(f"10.0.0.{i}")) == model[f"10.0.0.{i}"]
    table.close()


# --- the restart policy and the setting ---------------------------------------------------------
def test_a_crash_looping_worker_backs_off_and_a_stable_one_restarts_at_once() -> None:
    delays, streak = [], 0
    for _ in range(10):
        r = after_exit(uptime=0.3, streak=streak)
        delays.append(r.delay)
        streak = r.streak
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert delays[-1] == MAX_DELAY
    assert after_exit(uptime=STABLE_AFTER + 1, streak=streak).delay == 0.0
    assert after_exit(uptime=STABLE_AFTER + 1, streak=streak).streak == 0


def test_workers_setting() -> None:
    cfg = base_config(Path("/tmp"), None)
    assert loads(json.dumps(cfg)).workers == 1
    assert worker_count(loads(json.dumps({**cfg, "workers": "auto"})).workers) == len(os.sched_getaffinity(0))
    assert worker_count(loads(json.dumps({**cfg, "workers": 3})).workers) == 3
    with pytest.raises(ConfigError) as e:
        loads(json.dumps({**cfg, "workers": 0}))
    assert "workers" in e.value.problems[0] and "auto" in e.value.problems[0]


# --- what runs once per host --------------------------------------------------------------------
async def test_purge_and_store_gauges_run_in_worker_0_only(tmp: Path, upstream: Upstream) -> None:
    """Two workers' Servers in this process, as `serve` builds them from SMTPGUARD_WORKER."""
    run = tmp / "run"
    (run / "metrics").mkdir(parents=True)
    ConnectionTable.sized_for(run / "connections", workers=2, max_connections=10, create=True).close()
    port = free_port()
    holder = bound_socket("127.0.0.1", port, reuseport=True)  # the supervisor's reservation
    cfg = base_config(tmp, upstream.port)
    jobs: dict[int, set[str]] = {}
    for index in (0, 1):
        role = WorkerRole(index, 2, run, REUSEPORT, [("127.0.0.1", port, -1)], None, os.getppid())
        server = Server(loads(json.dumps(cfg)), role=role)
        await server.start()
        try:
            jobs[index] = {t.get_coro().__name__ for t in server._tasks}  # type: ignore[union-attr]
            assert server.ports == [port]
            assert server.instance.endswith(f":{os.getpid()}")
            reply = await send(port, message(f"once:{index}"))
            assert reply.code == 250
        finally:
            await server.stop()
    holder.close()
    assert {"_purge", "_count_records", "_flush_stats", "_refresh_gauges"} <= jobs[0]
    assert "_purge" not in jobs[1] and "_count_records" not in jobs[1]
    assert {"_flush_stats", "_refresh_gauges", "_watch_supervisor"} <= jobs[1]
    assert upstream.event_keys() == ["once:0", "once:1"]


# --- serve with workers: 2 ----------------------------------------------------------------------
@dataclass
class Pool:
    guard: GuardProcess
    port: int
    metrics_port: int
    config_path: Path
    cfg: dict[str, Any]

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.guard.log_path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    out.append(entry)
        return out

    def decisions(self) -> list[dict[str, Any]]:
        return [e for e in self.lines() if e.get("msg") == "decision"]

    def worker_pids(self) -> dict[int, int]:
        """Worker index → pid of its latest start, from the supervisor's log."""
        return {e["worker"]: e["pid"] for e in self.lines() if e.get("msg") == "worker ready"}

    def status(self, path: str) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5) as r:
            return int(r.status)

    def scrape(self) -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read()
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


async def wait_for(what: str, ok: Any, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def pool(tmp: Path, upstream: Upstream, workers: int = 2, **overrides: Any) -> AsyncIterator[Pool]:
    port, metrics_port = free_port(), free_port()
    cfg = base_config(tmp, upstream.port, workers=workers, **overrides)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    cfg["metrics"] = {"address": f"127.0.0.1:{metrics_port}"}
    path = write_config(tmp / "c.yaml", cfg)
    guard = GuardProcess(path, tmp / "guard.log")
    guard.start()
    p = Pool(guard, port, metrics_port, path, cfg)
    try:
        await guard.wait_port(port)
        if workers > 1:
            await wait_for("every worker ready", lambda: len(p.worker_pids()) == workers)
        yield p
    except BaseException:
        print(f"--- guard.log ---\n{guard.log_path.read_text()[-5000:]}")
        raise
    finally:
        code = await guard.astop(timeout=30)
    assert code == 0, f"unclean stop: {code}\n{guard.log_path.read_text()[-3000:]}"


@pytest.fixture(params=["sqlite", "redis", "postgres"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Iterator[dict[str, Any]]:
    if request.param == "sqlite":
        yield {"store__url": f"sqlite:///{tmp / 'state.db'}"}
    elif request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
        plain = redis.Redis.from_url(url)
        plain.flushdb()
        # The session's redis-server does not fsync every write; these tests do not restart it.
        yield {"store__url": url, "store__unsafe": True}
        plain.flushdb()
        plain.close()
    else:
        from tests.store.test_postgres import database

        pg: PostgresServer = request.getfixturevalue("postgres_server")
        yield {"store__url": database(pg)}


@pytest.mark.slow
async def test_two_workers_share_the_traffic_send_each_key_once_and_report_one_sum(
    tmp: Path, upstream: Upstream, store: dict[str, Any]
) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=0.2)
    # SQLite in WAL across processes (BEGIN IMMEDIATE makes reserve atomic between them)
    # with three workers on one file; the servers' stores with two.
    workers = 3 if store["store__url"].startswith("sqlite") else 2
    async with pool(tmp, upstream, workers=workers, **store) as p:
        distinct = await asyncio.gather(*(send(p.port, message(f"w:{i}")) for i in range(40)))
        # The duplicate storm: one key from 20 clients at once, over both workers.
        storm = await asyncio.gather(*(send(p.port, message("w:storm")) for _ in range(20)))
        # Each worker flushes its counters to its metrics file on its own: the sum is read
        # once all 60 decisions are in it, not after a guessed time.
        relayed_or_duplicate = (
            'smtpguard_submissions_total{decision="relayed",zone="acme"}',
            'smtpguard_submissions_total{decision="duplicate",zone="acme"}',
        )
        scraped = await eventually(
            lambda: asyncio.to_thread(p.scrape),
            lambda m: sum(m.get(name, 0) for name in relayed_or_duplicate) >= 60,
            timeout=15,
            interval=0.1,
        )
        health = [p.status(path) for path in ("/healthz", "/readyz") for _ in range(4)]
        decisions = p.decisions()
    by_worker = Counter(d["worker"] for d in decisions)
    counts = Counter(upstream.event_keys())
    relayed = scraped.get('smtpguard_submissions_total{decision="relayed",zone="acme"}', 0)
    duplicate = scraped.get('smtpguard_submissions_total{decision="duplicate",zone="acme"}', 0)
    print(
        f"workers {workers} on {store['store__url'].split(':')[0]}: decisions per worker {dict(by_worker)}, "
        f"upstream {len(upstream.received)}, /metrics relayed={relayed} duplicate={duplicate}"
    )
    assert [r.code for r in distinct] == [250] * 40
    assert [r.code for r in storm] == [250] * 20
    assert sum("duplicate" in r.text for r in storm) == 19
    assert counts == Counter([*(f"w:{i}" for i in range(40)), "w:storm"])
    assert set(by_worker) == set(range(workers)), "the kernel left a worker without connections"
    assert (relayed, duplicate) == (41, 19)
    assert health == [200] * 8
    assert sum(by_worker.values()) == 60


async def _send_or_lost(port: int, key: str) -> Reply:
    try:
        return await send(port, message(key), timeout=10)
    except (aiosmtplib.SMTPException, OSError):
        return Reply(0, "connection lost")


async def _retry(port: int, key: str) -> str:
    for _ in range(40):
        reply = await _send_or_lost(port, key)
        if reply.code == 250:
            return "delivered"
        if reply.code == 451 and reply.text.startswith("4.3.0") and "held" in reply.text:
            return "held"
        await asyncio.sleep(0.25)  # in flight under the dead worker's lease: wait it out
    raise AssertionError(f"{key}: no definitive answer after the restart")


@pytest.mark.slow
async def test_kill_9_of_a_worker_is_restarted_and_sends_nothing_twice(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=0.3)
    async with pool(
        tmp,
        upstream,
        event_key={"inflight_wait": "200ms", "min_retry_interval": "60s", "lease": "1s", "strip": False},
    ) as p:
        victim = p.worker_pids()[1]
        keys = [f"k9:{i}" for i in range(30)]
        first = [asyncio.create_task(_send_or_lost(p.port, k)) for k in keys]
        await asyncio.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        replies = await asyncio.gather(*first)
        await wait_for("worker 1 restarted", lambda: p.worker_pids()[1] != victim)
        after = await asyncio.gather(*(send(p.port, message(f"k9:after:{i}")) for i in range(10)))
        # Every key of the first wave again, as its client retries, until it has an answer.
        answers = dict(zip(keys, await asyncio.gather(*(_retry(p.port, k) for k in keys)), strict=True))
        exits = [e for e in p.lines() if e.get("msg") == "worker exited; restarting it"]
    counts = Counter(upstream.event_keys())
    lost_first = sum(r.code == 0 for r in replies)
    print(
        f"kill -9 of worker 1 mid-traffic: {lost_first} of 30 sessions cut, afterwards "
        f"{Counter(answers.values())}; upstream duplicates "
        f"{sum(n > 1 for n in counts.values())}; exit logged as {exits[0]['status'] if exits else None}"
    )
    assert [e["status"] for e in exits] == ["killed by SIGKILL"]
    assert exits[0]["worker"] == 1 and exits[0]["pid"] == victim
    assert [r.code for r in after] == [250] * 10
    assert all(n == 1 for n in counts.values()), counts
    # Delivered: exactly once upstream. Held unknown (the dot may have gone): at most once.
    assert all(counts[k] == 1 for k, a in answers.items() if a == "delivered")
    assert all(counts[k] <= 1 for k, a in answers.items() if a == "held")
    assert all(counts[f"k9:after:{i}"] == 1 for i in range(10))


@pytest.mark.slow
async def test_sighup_reaches_every_worker_and_a_broken_config_reaches_none(
    tmp: Path, upstream: Upstream
) -> None:
    async with pool(tmp, upstream, zones__globex__delivery="queue") as p:
        # Store-and-forward: every worker runs a queue worker; claims are atomic in the store.
        queued = await asyncio.gather(
            *(
                send(
                    p.port,
                    message(f"q:{i}", sender="app@globex.example"),
                    user="globex-app",
                    password=OTHER_PASSWORD,
                    sender="app@globex.example",
                )
                for i in range(20)
            )
        )
        await upstream.wait_received(20)
        new_sender = "billing@new-brand.example"
        before = await send(p.port, message("hup:0", sender=new_sender), sender=new_sender)
        cfg = p.cfg
        cfg["zones"]["acme"]["senders"] = [*cfg["zones"]["acme"]["senders"], new_sender]
        write_config(p.config_path, cfg)
        os.kill(p.guard.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await wait_for(
            "both workers reloaded", lambda: sum(e.get("msg") == "config reloaded" for e in p.lines()) == 2
        )
        accepted = await asyncio.gather(
            *(send(p.port, message(f"hup:{i}", sender=new_sender), sender=new_sender) for i in range(1, 21))
        )
        # A broken file is refused by the supervisor; no worker sees it.
        p.config_path.write_text(p.config_path.read_text() + "\nbogus_key: 1\n")
        os.kill(p.guard.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await wait_for(
            "refusal logged", lambda: any(e.get("msg", "").startswith("reload refused") for e in p.lines())
        )
        still = await asyncio.gather(
            *(send(p.port, message(f"hup:b{i}", sender=new_sender), sender=new_sender) for i in range(10))
        )
        lines = p.lines()
    by_worker = Counter(
        d["worker"]
        for d in p.decisions()
        if (d["event_key"] or "").startswith("hup:") and d["decision"] == "relayed"
    )
    reloaded = sorted(e["worker"] for e in lines if e.get("msg") == "config reloaded")
    refused = [e for e in lines if e.get("msg", "").startswith("reload refused")]
    assert before.code == 550
    assert reloaded == [0, 1]
    assert [r.code for r in accepted] == [250] * 20
    assert set(by_worker) == {0, 1}
    assert len(refused) == 1 and refused[0]["logger"] == "smtpguard.supervisor"
    assert "bogus_key" in " ".join(refused[0]["problems"])
    assert [r.code for r in still] == [250] * 10
    deliveries = Counter(
        d["worker"] for d in p.decisions() if d["user"] == "delivery" and d["decision"] == "relayed"
    )
    assert [r.code for r in queued] == [250] * 20
    # Both workers run a delivery worker; which one claims each entry is the scheduler's to
    # say (one may take all 20 on a busy machine). The promise is each key once, below.
    assert sum(deliveries.values()) == 20 and set(deliveries) <= {0, 1}, deliveries
    assert Counter(upstream.event_keys()) == Counter(
        [
            *(f"q:{i}" for i in range(20)),
            *(f"hup:{i}" for i in range(1, 21)),
            *(f"hup:b{i}" for i in range(10)),
        ]
    )


async def _greeting(port: int, source: str) -> str:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.bind((source, 0))
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    line = await asyncio.wait_for(reader.readline(), 5)
    _open.append(writer)
    return line.decode().strip()


_open: list[asyncio.StreamWriter] = []


async def no_connections_open(p: Pool) -> None:
    """Until the workers' shared connection table counts no connection open: every worker
    has seen its clients' hang-ups (each releases its own on the close it reads)."""
    workers = p.worker_pids()
    table = ConnectionTable.attach(_run_dir(workers[0]) / "connections", len(workers))
    try:
        left = await eventually(table.open_connections, lambda n: n == 0, timeout=10, interval=0.05)
    finally:
        table.close()
    assert left == 0, f"{left} connections still counted open"


@pytest.mark.slow
async def test_connection_limits_and_auth_lockout_are_global_across_workers(
    tmp: Path, upstream: Upstream
) -> None:
    async with pool(
        tmp,
        upstream,
        limits={"max_connections": 5, "max_connections_per_ip": 3, "auth_failures": 3},
    ) as p:
        # The start-up probe's connection (GuardProcess.wait_port) is released at its EOF.
        await no_connections_open(p)
        try:
            from_one = [await _greeting(p.port, "127.0.0.1") for _ in range(4)]
            from_two = [await _greeting(p.port, "127.0.0.2") for _ in range(4)]
        finally:
            for w in _open:
                w.close()
            _open.clear()
        await no_connections_open(p)  # the workers have seen the hang-ups
        again = [await _greeting(p.port, "127.0.0.3") for _ in range(3)]
        for w in _open:
            w.close()
        _open.clear()
        await no_connections_open(p)
        # AUTH: 3 failures from one address, whichever worker saw them, lock it out.
        wrong = [(await attempt(p.port, plain("acme-app", "wrong")))[0] for _ in range(10)]
        right, hung_up = await attempt(p.port, plain("acme-app", PASSWORD))
        lines = p.lines()
    busy = "421 4.7.0 Too many connections"
    assert [g.startswith("220") for g in from_one] == [True, True, True, False]
    assert from_one[3].startswith(busy)
    assert [g.startswith("220") for g in from_two] == [True, True, False, False]
    assert [g.startswith("220") for g in again] == [True] * 3
    assert [r.code for r in wrong] == [535] * 2 + [421] * 8
    assert right.code == 421 and hung_up
    locking = Counter(
        e["worker"] for e in lines if e.get("msg") in ("authentication failed", "AUTH locked out")
    )
    assert set(locking) == {0, 1}
    assert upstream.received == []


@pytest.mark.slow
async def test_a_taken_port_fails_the_start_before_any_worker_runs(tmp: Path, upstream: Upstream) -> None:
    """Also a port held by a SO_REUSEPORT group (another smtpguard's workers), which a
    SO_REUSEPORT bind would silently join."""
    for reuseport in (False, True):
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = base_config(tmp, upstream.port, workers=2)
        cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
        log = tmp / f"taken-{reuseport}.log"
        guard = GuardProcess(write_config(tmp / "c.yaml", cfg), log)
        guard.start()
        assert guard.proc is not None
        code = await asyncio.to_thread(guard.proc.wait, 20)
        guard.stop()
        held.close()
        text = log.read_text()
        assert code == 1
        assert f"listen[0].address: cannot listen on 127.0.0.1:{port}: Address already in use" in text
        assert "worker started" not in text and "Traceback" not in text


@pytest.mark.slow
async def test_a_worker_that_cannot_start_stops_the_service(
    tmp: Path, upstream: Upstream, redis_server: RedisServer
) -> None:
    """The session's redis-server does not fsync: without store.unsafe every worker refuses
    it at start (DESIGN.md §15), and the supervisor exits 1 rather than restart them forever."""
    cfg = base_config(
        tmp, upstream.port, workers=2, store__url=redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    )
    cfg["listen"] = [{"address": f"127.0.0.1:{free_port()}", "tls": "none"}]
    guard = GuardProcess(write_config(tmp / "c.yaml", cfg), tmp / "guard.log")
    guard.start()
    assert guard.proc is not None
    code = await asyncio.to_thread(guard.proc.wait, 30)
    guard.stop()
    text = (tmp / "guard.log").read_text()
    assert code == 1
    assert "appendonly" in text and "worker failed to start; stopping" in text
    assert "restarting it" not in text


@pytest.mark.slow
async def test_inherited_socket_where_there_is_no_so_reuseport(tmp: Path, upstream: Upstream) -> None:
    """The fallback: the supervisor listens and the workers accept on its socket."""
    port = free_port()
    cfg = base_config(tmp, upstream.port, workers=2)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    path = write_config(tmp / "c.yaml", cfg)
    code = (
        "import sys, smtpguard.supervisor as s; s.reuseport_available = lambda: False; "
        "from smtpguard.cli import main; sys.exit(main(['serve', '-c', sys.argv[1]]))"
    )
    guard = GuardProcess(path, tmp / "guard.log")
    guard.start = lambda: _start_python(guard, code, path)  # type: ignore[method-assign]
    guard.start()
    try:
        await guard.wait_port(port)
        replies = await asyncio.gather(*(send(port, message(f"inh:{i}")) for i in range(10)))
        storm = await asyncio.gather(*(send(port, message("inh:storm")) for _ in range(10)))
    finally:
        rc = await guard.astop(timeout=30)
    text = (tmp / "guard.log").read_text()
    assert '"sockets":"inherit"' in text
    assert [r.code for r in [*replies, *storm]] == [250] * 20
    assert sum("duplicate" in r.text for r in storm) == 9
    assert Counter(upstream.event_keys()) == Counter([*(f"inh:{i}" for i in range(10)), "inh:storm"])
    assert rc == 0


def _start_python(guard: GuardProcess, code: str, path: Path) -> None:
    import subprocess
    import sys

    guard._log = open(guard.log_path, "ab")  # noqa: SIM115 - closed by guard.stop()
    guard.proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)],
        stdout=guard._log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


# --- signals at awkward moments -----------------------------------------------------------------
@pytest.mark.slow
async def test_a_sighup_to_the_whole_group_while_workers_start_stops_nothing(
    tmp: Path, upstream: Upstream
) -> None:
    """A terminal hang-up or `kill -HUP -PGID` reaches the workers too. One still starting
    (Python importing, no handler yet) must not die of it: at start that failed the service."""
    port = free_port()
    cfg = base_config(tmp, upstream.port, workers=2)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    path = write_config(tmp / "c.yaml", cfg)
    guard = GuardProcess(path, tmp / "guard.log")
    p = Pool(guard, port, 0, path, cfg)
    guard.start()
    try:
        await wait_for("both spawned", lambda: sum(e.get("msg") == "worker started" for e in p.lines()) == 2)
        guard._signal(signal.SIGHUP)  # the whole process group, as GuardProcess signals
        await guard.wait_port(port)
        await wait_for("every worker ready", lambda: len(p.worker_pids()) == 2)
        replies = await asyncio.gather(*(send(port, message(f"grp:{i}")) for i in range(10)))
    finally:
        rc = await guard.astop(timeout=30)
    text = guard.log_path.read_text()
    assert "killed by SIGHUP" not in text and "failed to start" not in text, text[-3000:]
    assert [r.code for r in replies] == [250] * 10
    assert Counter(upstream.event_keys()) == Counter(f"grp:{i}" for i in range(10))
    assert rc == 0


@pytest.mark.slow
async def test_a_reload_the_supervisor_refuses_is_counted_in_metrics(tmp: Path, upstream: Upstream) -> None:
    """docs/configuration.md: a refused reload is counted in
    smtpguard_config_reloads_total{result="refused"}; with workers the supervisor refuses it."""
    async with pool(tmp, upstream) as p:
        p.config_path.write_text(p.config_path.read_text() + "\nbogus_key: 1\n")
        os.kill(p.guard.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await wait_for(
            "refusal logged", lambda: any(e.get("msg", "").startswith("reload refused") for e in p.lines())
        )
        # Whichever worker answers the scrape.
        refused = [p.scrape().get('smtpguard_config_reloads_total{result="refused"}') for _ in range(6)]
        reply = await send(p.port, message("after-refusal"))
    assert refused == [1.0] * 6
    assert reply.code == 250 and upstream.event_keys() == ["after-refusal"]


@pytest.mark.slow
async def test_a_stop_while_a_dead_worker_waits_to_restart_is_a_clean_stop(
    tmp: Path, upstream: Upstream
) -> None:
    """`systemctl stop` inside a restart backoff: every running worker drained, so the
    supervisor exits 0 (pool() checks), not 1 for the crash it had already handled."""
    async with pool(tmp, upstream) as p:
        os.kill(p.worker_pids()[1], signal.SIGKILL)
        await wait_for(
            "the exit logged", lambda: any(e.get("msg") == "worker exited; restarting it" for e in p.lines())
        )
        # pool() sends SIGTERM now, within the restart delay of a worker this young.
    starts = [e for e in p.lines() if e.get("msg") == "worker started"]
    assert len(starts) == 2, "the stop came after the restart: the backoff was not exercised"


@pytest.mark.slow
async def test_a_provider_removed_by_reload_leaves_no_ready_series(tmp: Path, upstream: Upstream) -> None:
    """With workers:1 a removed (or changed) provider's smtpguard_provider_ready is removed
    at reload; each worker's multiprocess file keeps the last value it wrote, and every
    scrape kept reporting the provider gone as ready."""
    primary = base_config(tmp, upstream.port)["providers"][0]
    standby = {**primary, "name": "standby", "probe_interval": "1h"}
    series = 'smtpguard_provider_ready{provider="standby"}'
    async with pool(tmp, upstream, providers=[primary, standby]) as p:
        await wait_for("standby probed by both", lambda: all(p.scrape().get(series) == 1.0 for _ in range(4)))
        cfg = p.cfg
        cfg["providers"] = [primary]
        write_config(p.config_path, cfg)
        os.kill(p.guard.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await wait_for(
            "both workers reloaded", lambda: sum(e.get("msg") == "config reloaded" for e in p.lines()) == 2
        )
        after = [p.scrape().get(series) for _ in range(6)]
        reply = await send(p.port, message("after-removal"))
    assert after == [None] * 6
    assert reply.code == 250 and upstream.event_keys() == ["after-removal"]


def _run_dir(pid: int) -> Path:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    raw = next(e for e in environ if e.startswith(b"SMTPGUARD_WORKER="))
    return Path(json.loads(raw.split(b"=", 1)[1])["run_dir"])


@pytest.mark.slow
async def test_a_dead_workers_metrics_are_folded_in_once_not_kept_per_pid(
    tmp: Path, upstream: Upstream
) -> None:
    """Every scrape reads every worker's files, the dead ones' too (their counters must
    still count): without folding, each restart added two files, and a scrape of a host
    whose worker had died a thousand times took 1.7 s of a worker's event loop."""
    async with pool(tmp, upstream) as p:
        dead = []
        for round_ in range(3):
            replies = await asyncio.gather(*(send(p.port, message(f"fold:{round_}:{i}")) for i in range(6)))
            assert [r.code for r in replies] == [250] * 6
            victim = p.worker_pids()[1]
            os.kill(victim, signal.SIGKILL)
            dead.append(victim)
            await wait_for("worker 1 restarted", lambda v=victim: p.worker_pids()[1] != v)  # type: ignore[misc]
        metrics = _run_dir(p.worker_pids()[0]) / "metrics"
        files = sorted(f.name for f in metrics.iterdir())
        relayed = [
            p.scrape().get('smtpguard_submissions_total{decision="relayed",zone="acme"}') for _ in range(6)
        ]
        histogram = p.scrape().get(
            'smtpguard_submission_latency_seconds_count{decision="relayed",zone="acme"}'
        )
    assert not [f for f in files if any(f.endswith(f"_{pid}.db") for pid in dead)], files
    assert relayed == [18.0] * 6
    assert histogram == 18.0
    assert len(upstream.received) == 18


@pytest.mark.slow
async def test_a_reload_beyond_the_shared_tables_size_says_it_needs_a_restart(
    tmp: Path, upstream: Upstream
) -> None:
    """The connection table is mapped by every worker at the size the start gave it (room for
    twice max_connections, at least 1024 addresses): a reload raising max_connections past
    that cannot grow it, and more distinct addresses than it holds are refused."""
    async with pool(tmp, upstream, limits={"max_connections": 10}) as p:
        cfg = p.cfg
        cfg["limits"] = {"max_connections": 5000}
        write_config(p.config_path, cfg)
        os.kill(p.guard.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await wait_for(
            "both workers reloaded", lambda: sum(e.get("msg") == "config reloaded" for e in p.lines()) == 2
        )
        reply = await send(p.port, message("after-limits"))
        warned = [e for e in p.lines() if "max_connections" in e.get("msg", "")]
    assert len(warned) == 1 and warned[0]["logger"] == "smtpguard.supervisor", warned
    assert warned[0]["addresses"] == 1024 and warned[0]["configured"] == 5000
    assert reply.code == 250 and upstream.event_keys() == ["after-limits"]


@pytest.mark.slow
async def test_a_reload_every_worker_would_refuse_does_not_reach_a_restarted_worker(
    tmp: Path, upstream: Upstream
) -> None:
    """A TLS pair that does not load is refused by every worker's reload. Had the supervisor
    passed it on as the run's config, a worker restarted later would start on it, fail, and
    crash-loop: that worker lost for good."""
    from tests.support.hostile import make_cert

    cert, key = make_cert(tmp)
    async with pool(tmp, upstream, tls={"cert": str(cert), "key": str(key)}) as p:
        cfg = p.cfg
        cfg["tls"] = {"cert": str(cert), "key": str(p.config_path)}  # a file, but not a key
        write_config(p.config_path, cfg)
        os.kill(p.guard.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
        await wait_for(
            "refusal logged", lambda: any(e.get("msg", "").startswith("reload refused") for e in p.lines())
        )
        victim = p.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        await wait_for("worker 1 restarted", lambda: p.worker_pids()[1] != victim)
        replies = await asyncio.gather(*(send(p.port, message(f"tls:{i}")) for i in range(8)))
        lines = p.lines()
    refused = [e for e in lines if e.get("msg", "").startswith("reload refused")]
    assert [e["logger"] for e in refused] == ["smtpguard.supervisor"]
    assert not [e for e in lines if e.get("msg") == "config reloaded"]
    assert [r.code for r in replies] == [250] * 8
    assert Counter(upstream.event_keys()) == Counter(f"tls:{i}" for i in range(8))
