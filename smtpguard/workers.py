"""One worker process of `workers: N` (DESIGN.md §17): what makes it one of N.

The supervisor (smtpguard/supervisor.py) starts each worker as `smtpguard serve` with
SMTPGUARD_WORKER in its environment (JSON: index, count, the run directory, the resolved
listener ports, how to share them). The worker then runs the same Server as `workers: 1`,
with five differences, all asked of the `WorkerRole` here:

- its listening sockets join the supervisor's SO_REUSEPORT group (or are inherited from
  it where the platform has no SO_REUSEPORT), so the kernel spreads connections;
- connection limits are counted in the supervisor's shared table (connection_table.py);
- jobs that must run once per host (the ledger purge, the store-derived gauges, the
  provider-event and console listeners) run only in worker 0;
- metrics go to prometheus_client's multiprocess files, and any worker answering a scrape
  reports the sum (the metrics port is in the SO_REUSEPORT group too);
- its event loop answers the supervisor's heartbeat (smtpguard/heartbeat.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from smtpguard.connection_table import ConnectionTable, address_key
from smtpguard.heartbeat import Answerer
from smtpguard.listener import Connections

log = logging.getLogger("smtpguard.workers")

ENV = "SMTPGUARD_WORKER"
REUSEPORT = "reuseport"
INHERIT = "inherit"


def reuseport_available() -> bool:
    """SO_REUSEPORT with the kernel balancing accepted connections across the group (Linux
    3.9+, FreeBSD 12+ as SO_REUSEPORT_LB; elsewhere the option exists without balancing)."""
    if not hasattr(socket, "SO_REUSEPORT") or os.uname().sysname != "Linux":
        return False
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError:
        return False
    return True


def bound_socket(host: str, port: int, reuseport: bool) -> socket.socket:
    """A TCP socket bound to host:port (not listening yet). Raises OSError, e.g. EADDRINUSE."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host or "0.0.0.0", port))
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class WorkerRole:
    index: int
    count: int
    run_dir: Path
    mode: str
    """REUSEPORT: bind our own socket into the group; INHERIT: use the supervisor's fd."""
    listen: list[tuple[str, int, int]]
    """Per configured listener: host, resolved port, inherited fd (-1 with REUSEPORT)."""
    metrics: tuple[str, int, int] | None
    supervisor: int
    """The supervisor's pid: a worker whose parent changed stops (its supervisor died)."""
    heartbeat: int = -1
    """The inherited fd of this worker's end of the heartbeat (smtpguard/heartbeat.py)."""

    @property
    def singleton(self) -> bool:
        """Worker 0 runs what must run once per host."""
        return self.index == 0

    @property
    def metrics_dir(self) -> Path:
        return self.run_dir / "metrics"

    @property
    def config_path(self) -> Path:
        """The last config the supervisor accepted: a worker restarted after a refused
        reload gets the config every other worker runs, not the broken file."""
        return self.run_dir / "config.yaml"

    def instance(self, configured: str | None) -> str | None:
        """Each worker owns its leases under a name of its own."""
        return f"{configured}/{self.index}" if configured else None

    def to_env(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "count": self.count,
                "run_dir": str(self.run_dir),
                "mode": self.mode,
                "listen": self.listen,
                "metrics": self.metrics,
                "supervisor": self.supervisor,
                "heartbeat": self.heartbeat,
            }
        )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> WorkerRole | None:
        raw = (environ if environ is not None else os.environ).get(ENV)
        if not raw:
            return None
        d = json.loads(raw)
        metrics = d.get("metrics")
        return cls(
            index=int(d["index"]),
            count=int(d["count"]),
            run_dir=Path(d["run_dir"]),
            mode=str(d["mode"]),
            listen=[(str(h), int(p), int(fd)) for h, p, fd in d["listen"]],
            metrics=(str(metrics[0]), int(metrics[1]), int(metrics[2])) if metrics else None,
            supervisor=int(d["supervisor"]),
            heartbeat=int(d.get("heartbeat", -1)),
        )

    def _socket(self, host: str, port: int, fd: int) -> socket.socket:
        if self.mode == INHERIT:
            return socket.socket(fileno=fd)
        sock = bound_socket(host, port, reuseport=True)
        sock.listen(511)
        return sock

    def listen_socket(self, i: int) -> socket.socket:
        host, port, fd = self.listen[i]
        return self._socket(host, port, fd)

    def metrics_socket(self) -> socket.socket | None:
        if self.metrics is None:
            return None
        return self._socket(*self.metrics)

    def connections(self) -> SharedConnections:
        table = ConnectionTable.attach(self.run_dir / "connections", self.count)
        return SharedConnections(table, self.index)

    def mark_ready(self) -> None:
        """Listening, store open: the supervisor tells systemd once every worker is."""
        (self.run_dir / "ready" / str(os.getpid())).touch()

    def answer_heartbeats(self, on_gone: Callable[[], None]) -> Answerer | None:
        """Answer the supervisor's pings from the running loop (None: no heartbeat fd)."""
        return Answerer(self.heartbeat, on_gone) if self.heartbeat >= 0 else None

    def orphaned(self) -> bool:
        return os.getppid() != self.supervisor


class SharedConnections(Connections):
    """The listener's connection counts, with the limits checked against every worker's.

    When the shared table is busy (its lock held past a few tries: a worker stopped while it
    held it), a connection is judged on this worker's own counts instead, so the limits are
    per worker, not per host, until the table is free: a stalled neighbour costs precision
    for a moment, never this worker's event loop. Such a connection is kept and counted in
    the table once it is free, so from then on every worker is held to the limits by it."""

    FLUSH_AFTER = 0.05
    """Seconds between tries to apply releases the busy table could not take."""

    def __init__(self, table: ConnectionTable, worker: int) -> None:
        super().__init__()
        self.table = table
        self.worker = worker
        self._flush: asyncio.TimerHandle | None = None
        self._busy_logged = False

    def admit(self, ip: str, max_total: int, max_per_ip: int) -> bool:
        got = self.table.admit(self.worker, address_key(ip), max_total, max_per_ip)
        if got is None:
            if not self._busy_logged:
                self._busy_logged = True
                log.warning("connection table busy: this worker counts its own connections until it is free")
            if not super().admit(ip, max_total, max_per_ip):
                return False
            self.table.keep(self.worker, address_key(ip))
            self._schedule_flush()
            return True
        self._busy_logged = False
        if not got:
            return False
        self.total += 1
        self.per_ip[ip] += 1
        return True

    def release(self, ip: str) -> None:
        super().release(ip)
        if not self.table.release(self.worker, address_key(ip)):
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a stop): the next admit or release applies it
        self._flush = loop.call_later(self.FLUSH_AFTER, self._retry_flush)

    def _retry_flush(self) -> None:
        self._flush = None
        if not self.table.flush():
            self._schedule_flush()
