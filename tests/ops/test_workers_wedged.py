"""`workers: N` when a process stops without dying (DESIGN.md §18, "Workers"): a worker
stopped with SIGSTOP is replaced within `workers_heartbeat`; a supervisor killed with
`kill -9` leaves a run directory that the next start removes (and never a live one's); a
lock holder that stopped inside the shared connection table freezes no one's event loop.
Real processes, a real SMTP client, a recording upstream that counts what it received."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import aiosmtplib
import pytest

from smtpguard.config import ConfigError, loads
from smtpguard.connection_table import ConnectionTable, address_key
from smtpguard.heartbeat import Beat
from smtpguard.run_dir import LOCK, PREFIX, RunDir, remove_leftovers
from smtpguard.workers import SharedConnections
from tests.ops.test_workers import Pool, _run_dir, pool, wait_for
from tests.support import GuardProcess, Reply, Upstream, base_config, free_port, message, send, write_config

T = TypeVar("T")

HEARTBEAT = 10.0
"""The shortest workers_heartbeat there is."""


# --- the setting ------------------------------------------------------------------------------
def test_workers_heartbeat_setting() -> None:
    cfg = base_config(Path("/tmp"), None)
    assert loads(json.dumps(cfg)).workers_heartbeat == 30.0
    assert loads(json.dumps({**cfg, "workers_heartbeat": "10s"})).workers_heartbeat == 10.0
    for bad, says in (("9s", "at least 10.0"), ("2h", "at most 3600.0"), ("soon", "not a duration")):
        with pytest.raises(ConfigError) as e:
            loads(json.dumps({**cfg, "workers_heartbeat": bad}))
        assert e.value.problems[0].startswith("<config>: workers_heartbeat (line 1)"), e.value.problems
        assert says in e.value.problems[0]


# --- the heartbeat, on a real socket pair, with time passed in ------------------------------
def test_silence_is_counted_from_an_unanswered_ping_only() -> None:
    beat, worker = Beat.pair()
    worker.setblocking(False)

    def answer() -> int:
        with contextlib.suppress(BlockingIOError):
            pings = worker.recv(100)
            worker.send(b"!" * len(pings))
            return len(pings)
        return 0

    beat.restart(100.0)  # the worker started: its start is the first question
    assert beat.tick(100.0, 5.0) == 0.0
    assert beat.tick(101.0, 5.0) == 1.0  # asked again; counted from the start
    assert answer() == 1
    assert beat.tick(101.5, 5.0) == 0.0  # answered
    # The supervisor itself stopped for 100 s: it asked nothing, so no one is late.
    assert beat.tick(201.5, 5.0) == 0.0
    assert beat.tick(204.0, 5.0) == 2.5  # that ping still waits
    assert beat.tick(205.0, 5.0) == 3.5  # asked again; counted from the first one
    answer()
    assert beat.tick(205.1, 5.0) == 0.0
    # Silent from here: the silence grows from the next ping asked, past the heartbeat.
    silences = [beat.tick(205.1 + t, 5.0) for t in (1.0, 3.0, 5.0, 6.5)]
    assert silences == pytest.approx([0.0, 2.0, 4.0, 5.5])
    worker.close()
    assert beat.tick(213.0, 5.0) == pytest.approx(6.9)  # a closed end is no answer
    beat.close()


# --- the connection table with a stopped lock holder ------------------------------------------
@contextlib.contextmanager
def held_lock(path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Another process holding the table's lock and then stopped, as a worker stopped with
    SIGSTOP inside admit() is."""
    code = (
        "import fcntl, os, signal, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        deadline = time.monotonic() + 5
        while Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
            assert time.monotonic() < deadline, "the holder did not stop"
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def answered_while_held(call: Callable[[], T]) -> T:
    """`call`'s answer, given while held_lock holds: one that waited for the stopped holder's
    lock fails the test after 10 s instead of hanging it (the holder is killed when held_lock
    ends, which lets the call's thread finish)."""
    runner = ThreadPoolExecutor(1)
    try:
        return runner.submit(call).result(timeout=10)
    finally:
        runner.shutdown(wait=False)


async def test_a_stopped_lock_holder_blocks_no_event_loop(tmp: Path) -> None:
    """Before, admit() waited for the lock (fcntl.lockf blocking) in the event loop: a worker
    stopped while it held the lock froze every other worker's loop, heartbeat included."""
    path = tmp / "connections"
    ConnectionTable.sized_for(path, workers=2, max_connections=10, create=True).close()
    table = ConnectionTable.attach(path, 2)
    shared = SharedConnections(table, worker=1)
    one = "192.0.2.1"
    assert shared.admit(one, 5, 2)
    with held_lock(path):
        busy = answered_while_held(lambda: table.admit(1, address_key(one), 5, 2))
        # Judged on this worker's counts: it holds one of 192.0.2.1's two.
        local = [shared.admit(one, 5, 2), shared.admit(one, 5, 2)]
        shared.release(one)  # the connection admitted locally: it never reached the table
        shared.release(one)  # one the table counted: kept until the table is free
        assert table.pending == 1
    # The holder is gone; the kept release is applied on the loop's next try.
    await wait_for("the kept release applied", lambda: table.pending == 0, timeout=2)
    counts = (table.open_connections(), table.count(address_key(one)))
    assert busy is None  # answered "busy" while the lock was held, not after
    assert local == [True, False]
    assert counts == (0, 0)
    assert shared.admit(one, 5, 2) and table.count(address_key(one)) == 1
    table.close()


async def test_connections_admitted_while_the_table_was_busy_count_once_it_is_free(tmp: Path) -> None:
    """A stopped holder makes every worker judge on its own counts; once the table is free
    those connections must be in it, or each worker's share stays invisible to the others
    for as long as those connections last and a per-IP cap of 2 lets 4 workers hold 10."""
    path = tmp / "connections"
    ConnectionTable.sized_for(path, workers=4, max_connections=10, create=True).close()
    tables = [ConnectionTable.attach(path, 4) for _ in range(4)]
    workers = [SharedConnections(t, worker=i) for i, t in enumerate(tables)]
    one, cap = "192.0.2.7", 2
    with held_lock(path):
        during = [w.admit(one, 100, cap) for w in workers for _ in range(cap + 1)]
    # The holder is gone: the connections kept meanwhile reach the table on the next try.
    await wait_for("the kept admits applied", lambda: all(t.pending == 0 for t in tables), timeout=2)
    after = [w.admit(one, 100, cap) for w in workers for _ in range(cap)]
    open_at_once = sum(during) + sum(after)
    counted = (tables[0].count(address_key(one)), tables[0].open_connections())
    for w in workers:
        for _ in range(w.per_ip[one]):
            w.release(one)
    await wait_for("every release applied", lambda: all(t.pending == 0 for t in tables), timeout=2)
    left = (tables[0].count(address_key(one)), tables[0].open_connections())
    print(
        f"per-IP cap {cap}, 4 workers: {sum(during)} admitted while busy, {sum(after)} after; "
        f"{open_at_once} open at once"
    )
    assert sum(during) == 4 * cap  # while busy: per worker, the documented bound
    assert after == [False] * (4 * cap), "the table forgot what was admitted while it was busy"
    assert counted == (4 * cap, 4 * cap)
    assert left == (0, 0)
    for t in tables:
        t.close()


def test_forget_worker_waits_for_no_stopped_holder(tmp: Path) -> None:
    """The supervisor clears a dead worker's column; a stopped holder must not stop it (it is
    the one that would kill that holder), so it answers "not yet" and is asked again."""
    path = tmp / "connections"
    table = ConnectionTable.sized_for(path, workers=2, max_connections=10, create=True)
    assert table.admit(1, address_key("192.0.2.9"), 5, 5)
    with held_lock(path):
        done = answered_while_held(lambda: table.forget_worker(1))
    assert not done
    assert table.forget_worker(1)
    assert table.open_connections() == 0
    table.close()


# --- a wedged worker --------------------------------------------------------------------------
async def _until_delivered(port: int, key: str, deadline: float) -> tuple[str, int]:
    """One client that retries, as an MTA does, until its message gets a 250."""
    tries = 0
    while time.monotonic() < deadline:
        tries += 1
        try:
            reply = await send(port, message(key), timeout=HEARTBEAT * 3)
        except (aiosmtplib.SMTPException, OSError):
            reply = Reply(0, "connection lost")
        if reply.code == 250:
            return reply.text, tries
        await asyncio.sleep(0.2)
    raise AssertionError(f"{key}: no 250 by the deadline")


@pytest.mark.slow
async def test_a_stopped_worker_is_replaced_within_the_heartbeat(tmp: Path, upstream: Upstream) -> None:
    async with pool(tmp, upstream, workers_heartbeat=f"{HEARTBEAT:g}s") as p:
        victim = p.worker_pids()[1]
        survivor = p.worker_pids()[0]
        stopped = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        try:
            # Meanwhile: clients the kernel hands to the stopped worker wait for a greeting
            # until it is killed, then retry; the others are answered at once.
            keys = [f"wedged:{i}" for i in range(20)]
            sends = [asyncio.create_task(_until_delivered(p.port, k, stopped + HEARTBEAT + 30)) for k in keys]
            await wait_for("worker 1 replaced", lambda: p.worker_pids()[1] != victim, timeout=HEARTBEAT + 20)
            replaced = time.monotonic() - stopped
            results = await asyncio.gather(*sends)
            after = await asyncio.gather(*(send(p.port, message(f"after:{i}")) for i in range(10)))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        lines = p.lines()
    missed = [e for e in lines if e.get("msg") == "worker missed its heartbeat; killing it"]
    exits = [e for e in lines if e.get("msg") == "worker exited; restarting it"]
    counts = Counter(upstream.event_keys())
    retried = sum(tries > 1 for _, tries in results)
    print(
        f"SIGSTOP of worker 1: killed after {missed[0]['silent_s'] if missed else None} s of silence "
        f"(heartbeat {HEARTBEAT} s), replacement ready {replaced:.1f} s after the stop; "
        f"{retried} of 20 clients retried; upstream {len(upstream.received)} messages"
    )
    assert [(e["worker"], e["pid"]) for e in missed] == [(1, victim)]
    # Within the heartbeat: silence is judged every tick, an answer asked for every second.
    assert HEARTBEAT <= missed[0]["silent_s"] <= HEARTBEAT + 1.0
    assert [e["status"] for e in exits] == ["killed by SIGKILL (missed its heartbeat)"]
    assert p.worker_pids()[0] == survivor, "the running worker was replaced too"
    assert all("duplicate" not in text for text, _ in results)
    assert [r.code for r in after] == [250] * 10
    assert counts == Counter([*keys, *(f"after:{i}" for i in range(10))])


@pytest.mark.slow
async def test_a_worker_stopped_before_it_is_ready_is_replaced(tmp: Path, upstream: Upstream) -> None:
    """A restarted worker that wedges while it starts (here: SIGSTOP at once) answered no
    heartbeat, and was never asked for one: its slot stayed dead, silently, until the stop,
    which it then made unclean. It is asked from its start, and replaced like any other."""
    async with pool(tmp, upstream, workers_heartbeat=f"{HEARTBEAT:g}s") as p:
        old = p.worker_pids()[1]
        os.kill(old, signal.SIGKILL)

        def starting() -> list[int]:
            return [
                e["pid"]
                for e in p.lines()
                if e.get("msg") == "worker started" and e.get("worker") == 1 and e["pid"] != old
            ]

        await wait_for("worker 1 started again", starting, timeout=10)
        stuck = starting()[0]
        os.kill(stuck, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            await wait_for(
                "the stuck worker replaced",
                lambda: p.worker_pids()[1] not in (old, stuck),
                timeout=HEARTBEAT + 10,
            )
            replaced = time.monotonic() - stopped
            replies = await asyncio.gather(*(send(p.port, message(f"after:{i}")) for i in range(10)))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGKILL)
        lines = p.lines()
    missed = [e for e in lines if e.get("msg") == "worker missed its heartbeat; killing it"]
    print(f"a worker stopped while starting: replaced {replaced:.1f} s after the stop")
    assert [(e["worker"], e["pid"]) for e in missed] == [(1, stuck)]
    assert HEARTBEAT <= missed[0]["silent_s"] <= HEARTBEAT + 1.0
    assert [r.code for r in replies] == [250] * 10
    assert Counter(upstream.event_keys()) == Counter(f"after:{i}" for i in range(10))


@pytest.mark.slow
async def test_a_worker_busy_with_large_messages_at_the_shortest_heartbeat_is_not_killed(
    tmp: Path, upstream: Upstream
) -> None:
    """A message near limits.max_message_size holds its worker's loop for most of a second
    (parsed in one turn), and messages whose DATA ends together add up: at the shortest
    workers_heartbeat the config accepted (1s), a healthy worker was killed with every
    session it held (the clients saw their connection cut). The shortest is now 10s."""
    body = ("x" * 998 + "\n") * 24_000  # 24 MB, under the default 25 MB
    provider = {**base_config(tmp, upstream.port)["providers"][0], "timeouts": {"data": "60s"}}
    async with pool(tmp, upstream, workers_heartbeat=f"{HEARTBEAT:g}s", providers=[provider]) as p:
        pids = p.worker_pids()
        t0 = time.monotonic()
        replies = await asyncio.gather(
            *(send(p.port, message(f"large:{i}", body=body), timeout=90) for i in range(4)),
            return_exceptions=True,
        )
        took = time.monotonic() - t0
        lines = p.lines()
        after = p.worker_pids()
    missed = [e for e in lines if e.get("msg") == "worker missed its heartbeat; killing it"]
    print(f"4 messages of 24 MB at once: {took:.1f} s; killed for silence: {[e['silent_s'] for e in missed]}")
    assert missed == []
    assert after == pids
    assert [getattr(r, "code", repr(r)) for r in replies] == [250] * 4
    assert Counter(upstream.event_keys()) == Counter(f"large:{i}" for i in range(4))


# --- a killed supervisor's run directory ------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent, the test's pytest, has not reaped it).
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    return False


@pytest.mark.slow
async def test_a_kill_9_supervisors_run_directory_is_removed_at_the_next_start(
    tmp: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp / "tmpdir"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    port = free_port()
    cfg = base_config(tmp, upstream.port, workers=2)
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    path = write_config(tmp / "c.yaml", cfg)
    first = GuardProcess(path, tmp / "first.log")
    second = GuardProcess(path, tmp / "second.log")
    p1, p2 = Pool(first, port, 0, path, cfg), Pool(second, port, 0, path, cfg)
    try:
        first.start()
        await first.wait_port(port)
        await wait_for("first workers ready", lambda: len(p1.worker_pids()) == 2)
        assert (await send(port, message("before-kill"))).code == 250
        workers = list(p1.worker_pids().values())
        left = _run_dir(workers[0])
        assert first.proc is not None
        os.kill(first.proc.pid, signal.SIGKILL)  # the supervisor alone; its workers drain
        first.proc.wait()
        await wait_for("its workers gone", lambda: not any(_alive(w) for w in workers), timeout=20)
        assert left.is_dir() and left.parent == temp
        second.start()
        await second.wait_port(port)
        await wait_for("second workers ready", lambda: len(p2.worker_pids()) == 2)
        own = _run_dir(next(iter(p2.worker_pids().values())))
        # Another start now (a second service, a test) must leave the live one's directory.
        kept = remove_leftovers(temp)
        own_kept = own.is_dir()
        reply = await send(port, message("after-restart"))
        gone = "removed the run directory of a supervisor that is gone"
        removed = [e for e in p2.lines() if e.get("msg") == gone]
    finally:
        first.kill()
        rc = await second.astop(timeout=30)
    print(f"left by kill -9: {left.name}; removed at the next start: {[e['path'] for e in removed]}")
    assert not left.exists()
    assert [e["path"] for e in removed] == [str(left)]
    assert kept == [] and own_kept
    assert reply.code == 250
    assert upstream.event_keys() == ["before-kill", "after-restart"]
    assert rc == 0
    assert [d.name for d in temp.iterdir()] == []


def test_a_run_directory_is_kept_while_any_process_of_its_supervisor_lives(tmp: Path) -> None:
    """A worker still draining after its supervisor's kill -9 holds the inherited lock: the
    directory it still writes its metrics to is not removed under it; nor is one without
    a lock file (being made, or of an older release)."""
    run = RunDir.create(tmp)
    (run.path / "metrics").mkdir()
    bare = tmp / f"{PREFIX}older"
    bare.mkdir()
    drainer = subprocess.Popen(["sleep", "30"], pass_fds=[run.lock_fd])
    try:
        os.close(run.lock_fd)  # the supervisor is gone; its worker lives on
        with_drainer = remove_leftovers(tmp)
        still = run.path.is_dir()
    finally:
        drainer.kill()
        drainer.wait()
    after = remove_leftovers(tmp)
    assert with_drainer == [] and still
    assert after == [run.path] and not run.path.exists()
    assert bare.is_dir()


def test_the_run_directory_lock_is_free_only_when_released(tmp: Path) -> None:
    run = RunDir.create(tmp)
    fd = os.open(run.path / LOCK, os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, even against this very process
    os.close(fd)
    assert (run.path / LOCK).read_text() == f"{os.getpid()}\n"
    assert remove_leftovers(tmp) == []
    run.remove()
    assert not run.path.exists()
