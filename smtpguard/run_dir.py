"""The supervisor's run directory (`workers: N`): made at start, removed at exit, and a
killed supervisor's removed at the next start.

It holds what the workers share: the config they run, the connection table, the metrics
files, the ready marks. A supervisor killed with `kill -9` cannot remove it, and each such
death would leave one more in the temporary directory (a metrics file per worker that
ever ran, a connection table). So every start removes those whose owner is gone, and only
those: the owner is known by an flock on `supervisor.lock`, taken before the file gets its
name (so no one sees it unlocked) and shared with every worker the supervisor starts (they
inherit the descriptor), so the lock is free only once the supervisor and all its workers
are gone, whatever their pids have become since. A directory without that file is left
alone: it is being made, or belongs to a release that had no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "smtpguard-workers-"
LOCK = "supervisor.lock"


class RunDir:
    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self.lock_fd = lock_fd
        """Held (flock) while this supervisor or any of its workers lives: pass it on."""

    @classmethod
    def create(cls, parent: Path | None = None) -> RunDir:
        path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        staged = path / f"{LOCK}.new"
        fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else can hold it
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(staged, path / LOCK)
        return cls(path, fd)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


def remove_leftovers(parent: Path | None = None) -> list[Path]:
    """Remove the run directories of supervisors that are gone; the paths removed."""
    parent = parent or Path(tempfile.gettempdir())
    removed = []
    for path in sorted(parent.glob(f"{PREFIX}*")):
        try:
            st = path.lstat()
            fd = os.open(path / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, no lock file, or not ours to open
        try:
            if not path.is_dir() or path.is_symlink() or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its supervisor, or a worker of it still draining, lives
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
