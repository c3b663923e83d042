"""Open connections counted across worker processes: one small shared-memory table.

`limits.max_connections` and `max_connections_per_ip` are limits of the host, not of a
worker: split by N they would refuse a client whose connections happen to hash onto one
worker while another sits idle. The table is a file mapped by the supervisor and every
worker; a worker admits a connection under an exclusive POSIX lock on that file. POSIX
locks die with their process, so a worker killed with `kill -9` cannot leave the others
waiting, and the supervisor clears a dead worker's column before it starts the next one
(the kernel closed that worker's connections with it).

Layout: one int64 open-connection total per worker, then an open-addressing hash table
(linear probing, backward-shift deletion, so no tombstones accumulate) of client
addresses, each slot holding one int32 count per worker. A client address is its 16-byte
BLAKE2b digest. The table has room for twice the largest `max_connections` it was sized
for; more distinct addresses than that are refused, as the total would be anyway.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_KEY = 16


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

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

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
    def admit(self, worker: int, key: bytes, max_total: int, max_per_ip: int) -> bool:
        with self._locked():
            totals = self._totals()
            if sum(totals) >= max_total:
                return False
            i, found = self._find(key)
            if i < 0:
                return False
            counts = self._read(i)[2] if found else [0] * self.workers
            if sum(counts) >= max_per_ip:
                return False
            counts[worker] += 1
            self._write(i, key, True, counts)
            totals[worker] += 1
            self._total.pack_into(self._map, 0, *totals)
            return True

    def release(self, worker: int, key: bytes) -> None:
        with self._locked():
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

    def forget_worker(self, worker: int) -> None:
        """A worker is gone, and its connections with it: drop its counts, and rebuild the
        table from what is left (merging any slot a kill mid-update left twice)."""
        with self._locked():
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
        with self._locked():
            return sum(self._totals())

    def count(self, key: bytes) -> int:
        with self._locked():
            i, found = self._find(key)
            return sum(self._read(i)[2]) if found else 0
