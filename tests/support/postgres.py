"""A real PostgreSQL for tests: initdb in a folder of its own, a loopback port, and never root.

The server refuses to run as root; the tests (and CI) may be root. Then every PostgreSQL
program runs through `runuser` as an unprivileged user (`postgres` where Debian's package
created it, else `nobody`) that owns the data directory. A primary and a streaming standby
are two of these: `pg_basebackup -R` makes the standby, `promote()` fails over to it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from tests.support import free_port, wait_listening

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def pg_tool(name: str) -> str:
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed (scripts/test installs postgresql)")
    return found


def _unprivileged_user() -> str | None:
    """None when we are not root (run as ourselves), else the user to run the server as."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "smtpguard-test", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("no unprivileged user to run PostgreSQL as")


class PostgresServer:
    def __init__(self, port: int | None = None, name: str = "pg") -> None:
        self.port = port or free_port()
        self.user = _unprivileged_user()
        # pytest's tmp folders are private to root: a folder of our own under /tmp, owned by
        # the user the server runs as.
        self.dir = Path(tempfile.mkdtemp(prefix=f"smtpguard-{name}-"))
        self.dir.chmod(0o755)
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str, timeout: float = 60) -> str:
        argv = list(cmd) if self.user is None else ["runuser", "-u", self.user, "--", *cmd]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.dir)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({done.returncode}): {done.stderr or done.stdout}")
        return done.stdout

    def init(self, **settings: str) -> None:
        self._run(
            pg_tool("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
            "-E", "UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        self.configure(**settings)

    def configure(self, **settings: str) -> None:
        """Appended to postgresql.conf: a later line wins over an earlier one."""
        lines = {
            "port": str(self.port),
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.dir}'",
            "max_connections": "200",
            **settings,
        }
        with open(self.data / "postgresql.conf", "a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in lines.items())

    def start(self) -> None:
        self._run(pg_tool("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "30", "start")
        wait_listening(self.port, "postgres")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run(
                self._argv(pg_tool("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"),
                capture_output=True,
                timeout=30,
            )

    def kill(self) -> None:
        """kill -9 of the postmaster: a crash, no shutdown checkpoint, no goodbye to clients.
        Its backends notice the postmaster is gone and exit; they are killed too, so that no
        half-dead backend keeps answering on an open connection."""
        pid = self.pid()
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        os.kill(pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)

    def pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def base_backup_of(self, primary: PostgresServer) -> None:
        """Make this a streaming standby of `primary` (-R writes standby.signal and
        primary_conninfo), on this server's own port."""
        self._run(
            pg_tool("pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
            "-D", str(self.data), "-R", "-X", "stream", "-c", "fast", "--no-sync",
        )  # fmt: skip
        self.configure()

    def promote(self) -> None:
        self._run(pg_tool("pg_ctl"), "-D", str(self.data), "-w", "-t", "30", "promote")

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _argv(self, *cmd: str) -> list[str]:
        return list(cmd) if self.user is None else ["runuser", "-u", self.user, "--", *cmd]


def reset(url: str) -> None:
    """Empty every smtpguard table (the schema stays): a test starts from an empty store."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables "
                "WHERE schemaname = 'public' AND tablename <> 'smtpguard_schema'"
            )
        ]
        if tables:
            conn.execute("TRUNCATE " + ", ".join(f'"{t}"' for t in tables))
