"""Open connections counted across worker processes: one small shared-memory table.

`limits.max_connections` and `max_connections_per_ip` are limits of the host, not of a
worker: split by N they would refuse a client whose connections happen to hash onto one
worker while another sits idle. The table is a file mapped by the supervisor and every
worker; a worker admits a connection under an exclusive POSIX lock on that file. POSIX
locks die with their process, so a worker killed with `kill -9` cannot leave the others
waiting, and the supervisor clears a dead worker's column before it starts the next one
(the kernel closed that worker's connections with it).

The lock is only ever tried, never waited for (LOCK_NB, for at most 2 ms, and not at all
once its holder is seen stopped): admit and release run in a worker's event loop, and a
worker stopped while it held the lock (SIGSTOP, until its heartbeat runs out) would
otherwise freeze every other worker's loop with it, heartbeats included. The lock is held
for a few microseconds, so the tries almost always succeed; when they do not, admit
answers None (busy: the caller decides on its own counts, and `keep`s the connection it
admits so), and kept connections and releases are applied, in order, under the next lock
this process gets (`flush`). A connection admitted while the table was busy is thereby
counted in it as soon as it is free: the others are then held to the limits by it, so
the limits are per worker for the busy moment only, not for as long as those connections
last. bench/connection_table.py measures both ways.

Layout: one int64 open-connection total per worker, then an open-addressing hash table
(linear probing, backward-shift deletion, so no tombstones accumulate) of client
addresses, each slot holding one int32 count per worker. A client address is its 16-byte
BLAKE2b digest. The table has room for twice the largest `max_connections` it was sized
for; more distinct addresses than that are refused, as the total would be anyway.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import struct
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_KEY = 16
_PATIENCE = 0.002
"""Seconds an operation tries the lock (yielding the core between tries, so a holder that
waits for a core can finish) before it gives up: the longest an event loop is kept,
however long the lock is held (plus one yield when the machine is busy). A holder that is
stopped (SIGSTOP; it will not let go until it is killed) is given up on at once."""
_FLOCK = "hhqqi"
"""struct flock (Linux, native alignment): l_type, l_whence, l_start, l_len, l_pid."""
_BUSY = (errno.EACCES, errno.EAGAIN)


def address_key(ip: str) -> bytes:
    return hashlib.blake2b(ip.encode(), digest_size=_KEY).digest()


class ConnectionTable:
    def __init__(self, path: Path, workers: int, slots: int, create: bool = False) -> None:
        self.workers = workers
        self.slots = slots
        self._total = struct.Struct(f"<{workers}q")
        self._slot = struct.Struct(f"<{_KEY}sI{workers}i")
        self._table_at = self._total.size
        size = self._table_at + slots * self._slot.size
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        self._fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._kept: Counter[tuple[int, bytes]] = Counter()
        """Connections admitted on a worker's own counts while the table was busy, by
        (worker, key): counted, so a release of one not applied yet takes it back in O(1)."""
        self._releases: list[tuple[int, bytes]] = []

    @classmethod
    def sized_for(
        cls, path: Path, workers: int, max_connections: int, create: bool = False
    ) -> ConnectionTable:
        return cls(path, workers, slots=max(2 * max_connections, 1024), create=create)

    @classmethod
    def attach(cls, path: Path, workers: int) -> ConnectionTable:
        """The table the supervisor created, however many slots it gave it."""
        head = struct.calcsize(f"<{workers}q")
        slot = struct.calcsize(f"<{_KEY}sI{workers}i")
        return cls(path, workers, slots=(path.stat().st_size - head) // slot)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def _try_lock(self) -> bool:
        deadline = time.perf_counter() + _PATIENCE
        asked = False
        while True:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in _BUSY:
                    raise
            else:
                return True
            if not asked:
                asked = True
                if self._holder_stopped():
                    return False
            if time.perf_counter() >= deadline:
                return False
            os.sched_yield()  # the holder may be waiting for this core (2 cores, 3 workers)

    def _holder_stopped(self) -> bool:
        """Whether the process holding the lock is stopped (Linux; elsewhere: not known)."""
        try:
            query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            pid = struct.unpack(_FLOCK, fcntl.fcntl(self._fd, fcntl.F_GETLK, query))[4]
            if pid <= 0:
                return False
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
        except (OSError, struct.error, IndexError):
            return False
        return state in (b"T", b"t")

    def _unlock(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN)

    @contextmanager
    def _locked_blocking(self) -> Iterator[None]:
        """For inspection (tests, benches), never from an event loop."""
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            self._apply_pending()
            yield
        finally:
            self._unlock()

    @property
    def pending(self) -> int:
        """Connections and releases this process kept while the table was busy, not applied yet."""
        return self._kept.total() + len(self._releases)

    def _apply_pending(self) -> None:
        # Kept connections first: every release kept is of one counted in the table already
        # (a release of a kept one cancelled it), so the order within one lock is free.
        kept, self._kept = self._kept, Counter()
        releases, self._releases = self._releases, []
        for (worker, key), n in kept.items():
            for _ in range(n):
                self._count(worker, key)
        for worker, key in releases:
            self._release(worker, key)

    def flush(self) -> bool:
        """Apply what was kept while the table was busy; False: still busy, try again."""
        if not self._kept and not self._releases:
            return True
        if not self._try_lock():
            return False
        try:
            self._apply_pending()
        finally:
            self._unlock()
        return True

    # --- slots ---------------------------------------------------------------------------------
    def _read(self, i: int) -> tuple[bytes, bool, list[int]]:
        key, used, *counts = self._slot.unpack_from(self._map, self._table_at + i * self._slot.size)
        return key, bool(used), counts

    def _write(self, i: int, key: bytes, used: bool, counts: list[int]) -> None:
        self._slot.pack_into(self._map, self._table_at + i * self._slot.size, key, int(used), *counts)

    def _home(self, key: bytes) -> int:
        return int.from_bytes(key[:8], "little") % self.slots

    def _find(self, key: bytes) -> tuple[int, bool]:
        """(slot of key, True) or (the empty slot where it would go, False); (-1, False) when
        the table is full and key is not in it."""
        i = self._home(key)
        for _ in range(self.slots):
            k, used, _counts = self._read(i)
            if not used:
                return i, False
            if k == key:
                return i, True
            i = (i + 1) % self.slots
        return -1, False

    def _delete(self, i: int) -> None:
        """Empty slot i, moving later members of its probe run back so lookups stay exact."""
        empty = [0] * self.workers
        self._write(i, b"\0" * _KEY, False, empty)
        j = i
        while True:
            j = (j + 1) % self.slots
            key, used, counts = self._read(j)
            if not used:
                return
            home = self._home(key)
            # Slot j may stay where it is when its home lies cyclically in (i, j].
            if (i < j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue
            self._write(i, key, True, counts)
            self._write(j, b"\0" * _KEY, False, empty)
            i = j

    def _totals(self) -> list[int]:
        return list(self._total.unpack_from(self._map, 0))

    # --- what workers and the supervisor do ----------------------------------------------------
    def admit(self, worker: int, key: bytes, max_total: int, max_per_ip: int) -> bool | None:
        """Count one more connection of `key` on `worker` if both limits allow it (True) or
        not (False). None: busy, the lock was not to be had without waiting; nothing counted."""
        if not self._try_lock():
            return None
        try:
            self._apply_pending()
            return self._admit(worker, key, max_total, max_per_ip)
        finally:
            self._unlock()

    def _admit(self, worker: int, key: bytes, max_total: int, max_per_ip: int) -> bool:
        if sum(self._totals()) >= max_total:
            return False
        i, found = self._find(key)
        if i < 0:
            return False
        if found and sum(self._read(i)[2]) >= max_per_ip:
            return False
        self._count(worker, key)
        return True

    def _count(self, worker: int, key: bytes) -> None:
        """One more connection of `key` on `worker`, whatever the limits (it is open)."""
        totals = self._totals()
        totals[worker] += 1
        self._total.pack_into(self._map, 0, *totals)
        i, found = self._find(key)
        if i < 0:
            return  # no slot left: counted in the total only; its release finds no slot either
        counts = self._read(i)[2] if found else [0] * self.workers
        counts[worker] += 1
        self._write(i, key, True, counts)

    def keep(self, worker: int, key: bytes) -> None:
        """A connection of `key` was admitted on `worker`'s own counts (admit answered None):
        count it in the table under the next lock this process gets (`flush`)."""
        self._kept[worker, key] += 1

    def release(self, worker: int, key: bytes) -> bool:
        """Count one connection of `key` on `worker` less. False: the table was busy and the
        release is kept for `flush` (or the next admit or release) to apply."""
        if self._kept[worker, key] > 0:
            self._kept[worker, key] -= 1  # it never reached the table: nothing to take back
            if not self._kept[worker, key]:
                del self._kept[worker, key]
        else:
            self._releases.append((worker, key))
        return self.flush()

    def _release(self, worker: int, key: bytes) -> None:
        totals = self._totals()
        totals[worker] = max(totals[worker] - 1, 0)
        self._total.pack_into(self._map, 0, *totals)
        i, found = self._find(key)
        if not found:
            return
        counts = self._read(i)[2]
        counts[worker] = max(counts[worker] - 1, 0)
        if any(counts):
            self._write(i, key, True, counts)
        else:
            self._delete(i)

    def forget_worker(self, worker: int) -> bool:
        """A worker is gone, and its connections with it: drop its counts, and rebuild the
        table from what is left (merging any slot a kill mid-update left twice). False: the
        table was busy (another worker holds the lock): call again before the worker's
        successor starts. The supervisor must not wait either: a stopped holder would keep
        it from the heartbeat that replaces that holder."""
        if not self._try_lock():
            return False
        try:
            self._forget_worker(worker)
        finally:
            self._unlock()
        return True

    def _forget_worker(self, worker: int) -> None:
        totals = self._totals()
        totals[worker] = 0
        self._total.pack_into(self._map, 0, *totals)
        live: dict[bytes, list[int]] = {}
        for i in range(self.slots):
            key, used, counts = self._read(i)
            if not used:
                continue
            counts[worker] = 0
            if any(counts):
                merged = live.setdefault(key, [0] * self.workers)
                for w, n in enumerate(counts):
                    merged[w] = max(merged[w], n)
        empty = [0] * self.workers
        for i in range(self.slots):
            self._write(i, b"\0" * _KEY, False, empty)
        for key, counts in live.items():
            i, _ = self._find(key)
            self._write(i, key, True, counts)

    def open_connections(self) -> int:
        with self._locked_blocking():
            return sum(self._totals())

    def count(self, key: bytes) -> int:
        with self._locked_blocking():
            i, found = self._find(key)
            return sum(self._read(i)[2]) if found else 0


class Connections:
    """Open connections, total and per client IP, shared by every listener."""

    def __init__(self) -> None:
        self.total = 0
        self.per_ip: Counter[str] = Counter()

    def admit(self, ip: str, max_total: int, max_per_ip: int) -> bool:
        if self.total >= max_total or self.per_ip[ip] >= max_per_ip:
            return False
        self.total += 1
        self.per_ip[ip] += 1
        return True

    def release(self, ip: str) -> None:
        self.total -= 1
        self.per_ip[ip] -= 1
        if self.per_ip[ip] <= 0:
            del self.per_ip[ip]
