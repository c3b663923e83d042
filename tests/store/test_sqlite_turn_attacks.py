"""The write turns of workers sharing one SQLite file (`<db>-lock`, smtpguard/store/sqlite/
writer.py) under attack: a lock file planted before the service starts, one left by another
user, a holder stopped or killed in the middle of its batch, the CLI writing beside a store,
two stores in one folder. Real processes, real files, real flocks; what each write left in
the file is counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from smtpguard.store import StoreUnavailable
from smtpguard.store.sqlite import SQLiteStore
from smtpguard.store.sqlite import writer as sqlite_writer
from tests.store.test_sqlite_group_commit import fresh
from tests.support import base_config, write_config
from tests.support.eventually import eventually

ROOT = Path(__file__).resolve().parents[2]
BOUND = 0.5
"""_BUSY_RETRY_FOR in this process, so that a stopped holder costs half a second, not 30."""


async def keys_in(path: Path) -> dict[str, int]:
    """Every record in the file and its version, read on a connection of its own."""

    def read() -> dict[str, int]:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            return {str(k): int(v) for k, v in conn.execute("SELECT key, version FROM events")}

    return await asyncio.to_thread(read)


# --- a lock file planted before the service starts ------------------------------------------
async def test_a_lock_planted_as_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """Whoever can write the store's folder plants `<db>-lock` pointing elsewhere: the store
    must neither create the target nor take its flocks on it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing, existing = elsewhere / "created-by-smtpguard", elsewhere / "precious"
    existing.write_text("keep me\n")
    for target, name in ((missing, "a.db"), (existing, "b.db")):
        (tmp_path / f"{name}-lock").symlink_to(target)
        store = SQLiteStore(f"sqlite:///{tmp_path / name}")
        await store.open()
        try:
            assert await asyncio.gather(*(store.put(fresh(f"k{i}"), None) for i in range(5))) == [None] * 5
            assert store._writer is not None and store._writer._turn is not None
            assert store._writer._turn._fd == -1, f"the store opened {target} through the planted link"
        finally:
            await store.close()
    assert not missing.exists(), "the store created the planted link's target"
    assert existing.read_text() == "keep me\n"
    assert (await keys_in(tmp_path / "a.db")) == {f"k{i}": 1 for i in range(5)}


async def test_a_lock_planted_as_a_fifo_does_not_hang_the_open(tmp_path: Path) -> None:
    """Opening a FIFO to read waits for a writer: the store's open, on the event loop's
    thread, would wait forever, and `serve` with it."""
    path = tmp_path / "f.db"
    os.mkfifo(f"{path}-lock")
    outcome: list[object] = []

    def run() -> None:
        async def go() -> None:
            store = SQLiteStore(f"sqlite:///{path}")
            await store.open()
            try:
                outcome.append(await store.put(fresh("k1"), None))
            finally:
                await store.close()

        asyncio.run(go())

    opener = threading.Thread(target=run, daemon=True)
    opener.start()
    await asyncio.to_thread(opener.join, 10)
    hung = opener.is_alive()
    if hung:  # a writer on the FIFO lets the stuck open return, so that the test can end
        fd = os.open(f"{path}-lock", os.O_WRONLY | os.O_NONBLOCK)
        await asyncio.to_thread(opener.join, 10)
        os.close(fd)
    assert not hung, "the store's open waited on a FIFO planted as its lock file"
    assert outcome == [None]
    assert (await keys_in(path)) == {"k1": 1}


async def test_a_lock_that_is_a_directory_leaves_writes_to_sqlites_lock(tmp_path: Path) -> None:
    path = tmp_path / "d.db"
    os.mkdir(f"{path}-lock")
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    try:
        assert await asyncio.gather(*(store.put(fresh(f"k{i}"), None) for i in range(20))) == [None] * 20
    finally:
        await store.close()
    assert (await keys_in(path)) == {f"k{i}": 1 for i in range(20)}


# --- another user's files -------------------------------------------------------------------
async def _as_user(path: Path) -> dict[str, object]:
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    try:
        done = await asyncio.gather(*(store.put(fresh(f"k{i}"), None) for i in range(10)))
        assert store._writer is not None and store._writer._turn is not None
        return {"done": [d is None for d in done], "turns": store._writer._turn._fd >= 0}
    finally:
        await store.close()


@pytest.fixture
def service_dir() -> Iterator[tuple[Path, str]]:
    """A folder owned by an unprivileged user, as /var/lib/smtpguard is by the service's."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as two users")
    user = "nobody"
    entry = pwd.getpwnam(user)
    folder = Path(tempfile.mkdtemp(prefix="smtpguard-turns-"))
    folder.chmod(0o750)
    os.chown(folder, entry.pw_uid, entry.pw_gid)
    try:
        yield folder, user
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def serve_as(user: str, path: Path) -> dict[str, object]:
    """The store opened and written by a process running as `user` (forked, since the
    interpreter itself may sit where that user cannot reach)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            entry = pwd.getpwnam(user)
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            os.write(w, json.dumps(asyncio.run(_as_user(path))).encode())
            code = 0
        except BaseException as e:
            os.write(w, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as out:
        got = out.read()
    _, status = os.waitpid(pid, 0)
    result: dict[str, object] = json.loads(got)
    assert os.waitstatus_to_exitcode(status) == 0, result
    return result


@pytest.mark.parametrize("mode", [0o644, 0o600])
async def test_the_service_as_its_own_user_after_the_cli_ran_as_root(
    service_dir: tuple[Path, str], mode: int
) -> None:
    """A store the service made, then a write of the CLI run as root before the lock file
    existed (a store of the release before turns), with root's umask: the service still
    writes; with a lock file it may not open, without turns."""
    folder, user = service_dir
    path = folder / "state.db"
    entry = pwd.getpwnam(user)
    first = serve_as(user, path)
    assert first == {"done": [True] * 10, "turns": True}
    os.unlink(f"{path}-lock")  # as a store of the previous release left it
    old = os.umask(0o777 & ~mode)
    try:
        root = SQLiteStore(f"sqlite:///{path}")
        await root.open()
        try:
            assert await root.put(fresh("held0"), None) is None
        finally:
            await root.close()
    finally:
        os.umask(old)
    lock = Path(f"{path}-lock")
    made = os.stat(lock)
    assert made.st_uid == 0 and made.st_mode & 0o777 == mode
    for p in folder.iterdir():  # any other file root's run left is the service's again (runbook)
        if p != lock:
            os.chown(p, entry.pw_uid, entry.pw_gid)
    # Records k0..k9 exist already: the second service run's puts of the same records are
    # answered as done, and write nothing (versions stay 1).
    again = serve_as(user, path)
    assert again["done"] == [True] * 10
    assert again["turns"] == (mode == 0o644)
    assert (await keys_in(path)) == {**{f"k{i}": 1 for i in range(10)}, "held0": 1}


# --- a holder stopped or killed in its batch ------------------------------------------------
_HOLDER = """
import asyncio, os, signal, sys, time
sys.path.insert(0, sys.argv[2])
from tests.store.test_sqlite_turn_attacks import fresh
from smtpguard.store.sqlite import SQLiteStore
from smtpguard.store.sqlite.rows import _cas

async def main():
    store = SQLiteStore("sqlite:///" + sys.argv[1])
    await store.open()
    def op(c):
        _cas(c, fresh("held0"), None)
        print("in", flush=True)
        if sys.argv[3] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
    await store._write(op, heavy=True)

asyncio.run(main())
"""

_FLOCK_ONLY = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("in", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


@contextlib.contextmanager
def holder(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, cwd=str(ROOT)
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "in"
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def is_stopped(pid: int) -> bool:
    for _ in range(200):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return True
        time.sleep(0.01)
    return False


def queued_on_flock(pid: int) -> bool:
    """Whether a thread of `pid` waits for a flock another holds: a `->` line of /proc/locks
    ("1: -> FLOCK  ADVISORY  WRITE PID ...")."""
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[1] == "->" and parts[2] == "FLOCK" and parts[5] == str(pid):
            return True
    return False


async def timed_put(store: SQLiteStore, key: str) -> tuple[object, float]:
    started = time.monotonic()
    try:
        result: object = await store.put(fresh(key), None)
    except StoreUnavailable as e:
        result = e
    return result, time.monotonic() - started


async def test_a_holder_stopped_in_its_transaction_holds_others_to_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker SIGSTOPped inside its batch holds the turn and SQLite's lock: every write of
    the others is answered (unavailable) within the two waits, none hangs; once the
    supervisor kills it, writes go through at once, and the stopped one's write is gone."""
    monkeypatch.setattr(sqlite_writer, "_BUSY_RETRY_FOR", BOUND)
    path = tmp_path / "s.db"
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    try:
        with holder(_HOLDER, str(path), str(ROOT), "stop") as proc:
            assert is_stopped(proc.pid)
            stalled = [await timed_put(store, f"k{i}") for i in range(3)]
            assert all(isinstance(r, StoreUnavailable) for r, _ in stalled), stalled
            assert all(took < 2 * BOUND + 1.0 for _, took in stalled), stalled
            proc.kill()  # what the supervisor does once the heartbeat runs out
            proc.wait()
            after = [await timed_put(store, f"k{i}") for i in range(3, 8)]
        assert [r for r, _ in after] == [None] * 5
        assert all(took < 1.0 for _, took in after), after
        # A failed write never wrote: the caller retries it, and it is written once.
        assert [await store.put(fresh(f"k{i}"), None) for i in range(3)] == [None] * 3
    finally:
        await store.close()
    assert (await keys_in(path)) == {f"k{i}": 1 for i in range(8)}


async def test_a_holder_stopped_between_its_turn_and_its_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped holding the flock alone (not SQLite's lock): the first write of the others
    waits out the bound, then it and every later one go in under SQLite's lock without
    waiting it out again (the bound is for the stop, not for each write of every session);
    none fails, none is written twice."""
    monkeypatch.setattr(sqlite_writer, "_BUSY_RETRY_FOR", BOUND)
    path = tmp_path / "s.db"
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    try:
        with holder(_FLOCK_ONLY, f"{path}-lock") as proc:
            assert is_stopped(proc.pid)
            stalled = [await timed_put(store, f"k{i}") for i in range(3)]
            together = await asyncio.gather(*(timed_put(store, f"k{i}") for i in range(3, 13)))
        print("stopped flock holder, sequential writes (s):", [round(t, 3) for _, t in stalled])
        print("then 10 at once (s):", [round(t, 3) for _, t in together])
        assert [r for r, _ in stalled + together] == [None] * 13
        assert BOUND <= stalled[0][1] < BOUND + 1.0
        assert all(took < BOUND / 2 for _, took in stalled[1:] + together)
        # The late turns came when the holder died, and were given back: no one keeps it.
        after = [await timed_put(store, f"k{i}") for i in range(13, 16)]
        assert [r for r, _ in after] == [None] * 3 and all(t < BOUND for _, t in after), after
    finally:
        await store.close()
    assert (await keys_in(path)) == {f"k{i}": 1 for i in range(16)}


def test_a_store_closes_while_a_stopped_holder_still_has_the_turn(tmp_path: Path) -> None:
    """A batch gave up waiting for a stopped holder's turn, and then the store closes (a
    worker draining on SIGTERM): the close must not wait for the turn that never comes. It
    runs on the event loop's thread, so a wait there stops the loop (and its heartbeat)."""
    path = tmp_path / "s.db"
    outcome: list[object] = []

    def run() -> None:
        async def go() -> None:
            store = SQLiteStore(f"sqlite:///{path}")
            await store.open()
            outcome.append(await store.put(fresh("k0"), None))
            started = time.monotonic()
            await store.close()
            outcome.append(time.monotonic() - started)

        asyncio.run(go())

    sqlite = SQLiteStore(f"sqlite:///{path}")
    asyncio.run(sqlite.open())
    asyncio.run(sqlite.close())
    with holder(_FLOCK_ONLY, f"{path}-lock") as proc:
        assert is_stopped(proc.pid)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sqlite_writer, "_BUSY_RETRY_FOR", BOUND)
            closing = threading.Thread(target=run, daemon=True)
            closing.start()
            closing.join(BOUND + 5)
            hung = closing.is_alive()
        proc.kill()  # lets a hung close end, so that the test can
        proc.wait()
        closing.join(10)
    assert not hung, "the store's close waited for a stopped holder's turn"
    assert outcome[0] is None and isinstance(outcome[1], float) and outcome[1] < 1.0, outcome


async def test_a_holder_killed_in_its_batch_lets_the_others_in_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of a worker in its transaction: the kernel lets go of its flock and SQLite's
    lock, the waiting writes go in within a moment, the killed batch left nothing."""
    monkeypatch.setattr(sqlite_writer, "_BUSY_RETRY_FOR", 10.0)
    path = tmp_path / "s.db"
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    try:
        with holder(_HOLDER, str(path), str(ROOT), "sleep") as proc:
            waiting = [asyncio.ensure_future(timed_put(store, f"k{i}")) for i in range(20)]
            # The writes have reached the turn and wait in the kernel for the holder's flock:
            # only then does "none done" say they are held, not merely not started.
            queued = await eventually(lambda: queued_on_flock(os.getpid()), timeout=5, interval=0.02)
            assert queued, "no write of this process waits for the holder's flock"
            assert not any(w.done() for w in waiting)
            killed = time.monotonic()
            proc.kill()
            proc.wait()
            results = await asyncio.gather(*waiting)
            took = time.monotonic() - killed
        print(f"writes in {took:.3f} s after the holder's kill -9")
        assert [r for r, _ in results] == [None] * 20
        assert took < 1.0
    finally:
        await store.close()
    assert (await keys_in(path)) == {f"k{i}": 1 for i in range(20)}


# --- the CLI beside a store; two stores in one folder ---------------------------------------
async def test_the_cli_writing_while_a_store_writes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    cfg = write_config(tmp_path / "c.yaml", base_config(tmp_path, None, store__url=f"sqlite:///{path}"))
    store = SQLiteStore(f"sqlite:///{path}")
    await store.open()
    stop = asyncio.Event()
    written: list[str] = []

    async def stream() -> None:
        i = 0
        while not stop.is_set():
            batch = [f"k{j}" for j in range(i, i + 10)]
            assert await asyncio.gather(*(store.put(fresh(k), None) for k in batch)) == [None] * 10
            written.extend(batch)
            i += 10

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "smtpguard", *argv, "-c", str(cfg)],
            capture_output=True, text=True, timeout=60, cwd=str(ROOT),
        )  # fmt: skip

    try:
        writer = asyncio.ensure_future(stream())
        before = len(written)
        runs = [
            await asyncio.to_thread(cli, "suppress", "add", "acme", f"x{n}@{n}.example") for n in range(3)
        ]
        during = len(written) - before
        stop.set()
        await writer
        assert [r.returncode for r in runs] == [0, 0, 0], [r.stderr for r in runs]
    finally:
        await store.close()
    out = cli("suppress", "list", "acme", "--json")
    assert out.returncode == 0, out.stderr
    addresses = sorted(e["address"] for e in json.loads(out.stdout)["entries"])
    assert addresses == [f"x{n}@{n}.example" for n in range(3)], addresses
    assert during > 0, "the store wrote nothing while the CLI did"
    assert (await keys_in(path)) == dict.fromkeys(written, 1)


async def test_two_stores_in_one_folder_take_turns_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_writer, "_BUSY_RETRY_FOR", 5.0)
    a, b = SQLiteStore(f"sqlite:///{tmp_path / 'a.db'}"), SQLiteStore(f"sqlite:///{tmp_path / 'b.db'}")
    await a.open()
    await b.open()
    try:
        with holder(_FLOCK_ONLY, f"{tmp_path / 'a.db'}-lock") as proc:
            assert is_stopped(proc.pid)
            results = [await timed_put(b, f"b{i}") for i in range(5)]
        assert [r for r, _ in results] == [None] * 5
        assert all(took < 0.5 for _, took in results), results
    finally:
        await b.close()
        await a.close()
    assert (await keys_in(tmp_path / "b.db")) == {f"b{i}": 1 for i in range(5)}
    assert (await keys_in(tmp_path / "a.db")) == {}
