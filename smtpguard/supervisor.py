"""`workers: N`: one supervisor process and N `smtpguard serve` workers (DESIGN.md §17).

The supervisor holds no event loop, no store connection and no client: it binds, spawns,
forwards signals and restarts. Each worker is a fresh interpreter (not a fork), so it
inherits no threads, locks or loop state, and a worker restarted an hour later starts
exactly as the first did.

Sockets. Where the kernel balances SO_REUSEPORT groups (Linux), each worker binds its own
listening socket to the same address and the kernel spreads new connections over them by
a hash of the peer, so one busy worker does not take every accept. The supervisor first
binds every address once, without SO_REUSEPORT, so a port held by anyone else (another
smtpguard included, which a SO_REUSEPORT bind would silently join) is a clear error
before any worker starts; then it keeps a bound, never-listening SO_REUSEPORT socket on
each, which reserves the port (and fixes the number a `:0` listener got) for the workers.
Elsewhere it listens itself and the workers inherit that socket.

Signals. SIGTERM/SIGINT: every worker drains (stops accepting, finishes in-flight
sessions within `limits.drain_timeout`), then the supervisor exits 0. SIGHUP: the
supervisor loads the file; a config that does not load is refused and logged here, and
no worker sees it. One that loads becomes the run directory's config.yaml (which workers,
and every restarted worker, read), and each worker is sent SIGUSR1 to reload it. Workers
ignore SIGHUP, so a signal sent to the whole process group is not applied twice.

A worker that dies is started again (smtpguard/policy/restart.py decides when), logged
with its exit status; its ledger leases cover what it had in flight. A worker that is
alive but whose event loop no longer answers the heartbeat for `workers_heartbeat`
(smtpguard/heartbeat.py) is killed, and then restarted like any dead one.

The run directory (smtpguard/run_dir.py) is removed at exit; one left by a supervisor
killed with `kill -9` is removed at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from smtpguard import notify
from smtpguard.config import Config, ConfigError, loads, provider_secrets, worker_count
from smtpguard.connection_table import ConnectionTable
from smtpguard.heartbeat import Beat
from smtpguard.metrics import count_refused_reload, fold_dead_worker
from smtpguard.policy.restart import after_exit
from smtpguard.run_dir import RunDir, remove_leftovers
from smtpguard.workers import ENV, INHERIT, REUSEPORT, WorkerRole, bound_socket, reuseport_available

log = logging.getLogger("smtpguard.supervisor")

TICK = 0.1
"""Seconds between looks at the workers and the signals that arrived."""
KILL_GRACE = 15.0
"""Seconds past drain_timeout a draining worker gets before it is killed."""


@dataclass
class Slot:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ready: bool = False
    ever_ready: bool = False
    streak: int = 0
    due: float | None = None
    """When to start it again (None: running, or not to be restarted)."""
    exits: list[int] = field(default_factory=list)
    reload_pending: bool = False
    """A reload arrived while it was starting: it gets SIGUSR1 once it is ready (before
    that, SIGUSR1 would kill it: its handler is not installed yet)."""
    beat: Beat | None = None
    wedged: bool = False
    """Killed for its silence: its exit is logged as such."""
    counted: bool = False
    """Its dead predecessor's connections are still in the shared table (the table was
    busy when it died): cleared before this slot starts again."""


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


def _worker_signals() -> None:
    """In the child, before exec: a worker is born ignoring SIGHUP and SIGUSR1 (an ignored
    signal stays ignored across exec). Until its loop installs its handlers, a SIGHUP sent
    to the whole process group (a terminal hang-up, `kill -HUP -PGID`) would otherwise kill
    it by default, and a worker dying at start stops the service; a reload sent meanwhile
    reaches it once it is ready (Slot.reload_pending)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class Supervisor:
    def __init__(self, config: Config, config_path: Path, run_dir: Path, lock_fd: int = -1) -> None:
        self.config = config
        self.config_path = config_path
        self.run_dir = run_dir
        self.lock_fd = lock_fd
        """The run directory's lock (run_dir.py), which every worker inherits."""
        self.count = worker_count(config.workers)
        self.mode = REUSEPORT if reuseport_available() else INHERIT
        self.sockets: list[socket.socket] = []
        self.listen: list[tuple[str, int, int]] = []
        self.metrics: tuple[str, int, int] | None = None
        self.slots = [Slot(i) for i in range(self.count)]
        self.signals: list[int] = []
        self.stopping = False
        self.stop_deadline = 0.0
        self.failed = False
        self.unclean = False
        """A worker did not stop cleanly once the stop began (killed after the drain bound,
        a crash in its drain): the supervisor then exits 1."""
        self.announced = False
        self.table: ConnectionTable | None = None

    # --- start -------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Everything that can be wrong before a worker starts, reported once, here."""
        config = self.config
        provider_secrets(config)
        if config.tls is not None:
            from smtpguard.server import tls_context

            tls_context(config)
        (self.run_dir / "metrics").mkdir()
        (self.run_dir / "ready").mkdir()
        shutil.copyfile(self.config_path, self.run_dir / "config.yaml")
        for i, lst in enumerate(config.listen):
            self.listen.append(self._bind(f"listen[{i}].address", lst.address))
        if config.metrics is not None:
            self.metrics = self._bind("metrics.address", config.metrics.address)
        # Worker 0 alone binds these: check now that it can.
        if config.events is not None and config.events.address is not None:
            self._check_free("events.address", config.events.address)
        if config.console is not None:
            self._check_free("console.address", config.console.address)
        self.table = ConnectionTable.sized_for(
            self.run_dir / "connections", self.count, config.limits.max_connections, create=True
        )

    def _check_free(self, where: str, address: str) -> tuple[str, int]:
        host, port = _host_port(address)
        try:
            probe = bound_socket(host, port, reuseport=False)
        except OSError as e:
            raise ConfigError([f"{where}: cannot listen on {address}: {e.strerror or e}"]) from None
        with probe:
            return host, probe.getsockname()[1]

    def _bind(self, where: str, address: str) -> tuple[str, int, int]:
        host, port = self._check_free(where, address)
        try:
            sock = bound_socket(host, port, reuseport=self.mode == REUSEPORT)
            if self.mode == INHERIT:
                sock.listen(511)
                sock.set_inheritable(True)
        except OSError as e:
            raise ConfigError([f"{where}: cannot listen on {address}: {e.strerror or e}"]) from None
        self.sockets.append(sock)
        return host, port, sock.fileno() if self.mode == INHERIT else -1

    def _role(self, index: int, heartbeat: int) -> WorkerRole:
        return WorkerRole(
            index=index,
            count=self.count,
            run_dir=self.run_dir,
            mode=self.mode,
            listen=self.listen,
            metrics=self.metrics,
            supervisor=os.getpid(),
            heartbeat=heartbeat,
        )

    def _spawn(self, slot: Slot) -> None:
        beat, theirs = Beat.pair()
        env = {**os.environ, ENV: self._role(slot.index, theirs.fileno()).to_env()}
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self.run_dir / "metrics")
        env.pop("NOTIFY_SOCKET", None)  # systemd hears from the supervisor only
        fds = [fd for _, _, fd in [*self.listen, *([self.metrics] if self.metrics else [])] if fd >= 0]
        fds.append(theirs.fileno())
        if self.lock_fd >= 0:
            fds.append(self.lock_fd)
        try:
            slot.proc = subprocess.Popen(
                [sys.executable, "-m", "smtpguard", "serve", "-c", str(self.run_dir / "config.yaml")],
                env=env,
                pass_fds=fds,
                preexec_fn=_worker_signals,
            )
        except BaseException:
            beat.close()
            raise
        finally:
            theirs.close()
        slot.beat = beat
        slot.wedged = False
        slot.started = time.monotonic()
        beat.restart(slot.started)
        slot.ready = False
        slot.reload_pending = False  # it reads the current config.yaml at start
        slot.due = None
        log.info("worker started", extra={"worker": slot.index, "pid": slot.proc.pid})

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        log.info(
            "supervisor started",
            extra={"workers": self.count, "sockets": self.mode, "pid": os.getpid()},
        )
        for slot in self.slots:
            self._spawn(slot)
        while True:
            while self.signals:
                self._handle(self.signals.pop(0))
            now = time.monotonic()
            for slot in self.slots:
                self._watch(slot, now)
            if self.stopping:
                if not any(s.proc for s in self.slots):
                    break
                if now >= self.stop_deadline:
                    self._kill_stragglers()
            time.sleep(TICK)
        for sock in self.sockets:
            sock.close()
        if self.table is not None:
            self.table.close()
        log.info("supervisor stopped")
        return 1 if self.failed or self.unclean else 0

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signals.append(signum)

    def _handle(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            if not self.stopping:
                self._reload()
        elif not self.stopping:
            self._stop("stopping: draining every worker")

    def _stop(self, why: str) -> None:
        self.stopping = True
        self.stop_deadline = time.monotonic() + self.config.limits.drain_timeout + KILL_GRACE
        notify.stopping()
        log.info(why)
        for slot in self.slots:
            slot.due = None
            if slot.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGTERM)

    def _kill_stragglers(self) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                log.warning("worker did not drain in time; killing it", extra={"worker": slot.index})
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.kill()
        self.stop_deadline = float("inf")

    def _watch(self, slot: Slot, now: float) -> None:
        proc = slot.proc
        if proc is None:
            if slot.counted and self.table is not None:
                slot.counted = not self.table.forget_worker(slot.index)
            if slot.due is not None and now >= slot.due and not self.stopping and not slot.counted:
                self._spawn(slot)
            return
        code = proc.poll()
        if code is None:
            self._heartbeat(slot, proc, now)
            if not slot.ready and (self.run_dir / "ready" / str(proc.pid)).exists():
                slot.ready = slot.ever_ready = True
                log.info("worker ready", extra={"worker": slot.index, "pid": proc.pid})
                if slot.reload_pending:
                    slot.reload_pending = False
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGUSR1)
                if not self.announced and all(s.ready for s in self.slots):
                    self.announced = True
                    notify.ready(f"serving {len(self.config.zones)} zone(s) with {self.count} workers")
            return
        slot.proc = None
        if slot.beat is not None:
            slot.beat.close()
            slot.beat = None
        if self.stopping and code in (-signal.SIGTERM, -signal.SIGINT) and not slot.ready:
            code = 0  # stopped while still starting (SIGINT: a Ctrl-C to the group): nothing to drain
        slot.exits.append(code)
        self._forget(proc.pid, slot)
        uptime = now - slot.started
        if self.stopping:
            # The exit status answers "did every worker stop cleanly": a worker that had
            # died before the stop was logged and handled then, and is not asked again.
            self.unclean = self.unclean or code != 0
            log.info(
                "worker stopped", extra={"worker": slot.index, "pid": proc.pid, "status": _describe(code)}
            )
            return
        exited: dict[str, object] = {
            "worker": slot.index,
            "pid": proc.pid,
            "status": _describe(code) + (" (missed its heartbeat)" if slot.wedged else ""),
        }
        if not self.announced and not slot.ever_ready:
            # At start, a worker that cannot start is a config or store problem that every
            # worker shares (its own log lines above say which): stop, as workers: 1 would.
            log.error("worker failed to start; stopping", extra=exited)
            self.failed = True
            self._stop("stopping: a worker failed to start")
            return
        restart = after_exit(uptime, slot.streak)
        slot.streak = restart.streak
        slot.due = now + restart.delay
        log.warning(
            "worker exited; restarting it",
            extra={
                **exited,
                "uptime_s": round(uptime, 1),
                "restart_in_s": restart.delay,
                "quick_exits": restart.streak,
            },
        )

    def _heartbeat(self, slot: Slot, proc: subprocess.Popen[bytes], now: float) -> None:
        if slot.beat is None or slot.wedged:
            return
        heartbeat = self.config.workers_heartbeat
        silent = slot.beat.tick(now, heartbeat)
        if silent <= heartbeat:
            return
        # SIGKILL: a stopped process cannot run a SIGTERM handler, and a wedged loop would
        # never drain. Its sockets close with it, so the kernel stops handing it
        # connections; its leases cover what it had in flight, as after any kill -9.
        log.error(
            "worker missed its heartbeat; killing it",
            extra={
                "worker": slot.index,
                "pid": proc.pid,
                "silent_s": round(silent, 1),
                "heartbeat_s": heartbeat,
            },
        )
        slot.wedged = True
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    def _forget(self, pid: int, slot: Slot) -> None:
        """A dead worker's connections are closed and its live gauges mean nothing now."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.run_dir / "metrics"))  # type: ignore[no-untyped-call]
        try:
            fold_dead_worker(self.run_dir / "metrics", pid)
        except (OSError, ValueError) as e:
            # Its counts stay in its own file: still summed, only one file more per scrape.
            log.warning("could not fold a dead worker's metrics", extra={"pid": pid, "error": str(e)})
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / "ready" / str(pid)).unlink()
        if self.table is not None:
            slot.counted = not self.table.forget_worker(slot.index)

    def _reload(self) -> None:
        notify.reloading()
        try:
            # One read: what was validated is exactly what the workers get.
            text = self.config_path.read_text()
            new = loads(text, source=str(self.config_path))
            # Everything a worker's reload would refuse (smtpguard/server/reload.py read):
            # a file passed on becomes what every restarted worker starts on, and one every
            # worker refuses would keep a restarted worker from starting at all.
            provider_secrets(new)
            from smtpguard.server import _event_sources, tls_context

            _event_sources(new)
            if new.tls is not None:
                tls_context(new)
        except (ConfigError, OSError) as e:
            problems = e.problems if isinstance(e, ConfigError) else [f"{self.config_path}: {e}"]
            log.error("reload refused; every worker keeps the running config", extra={"problems": problems})
            count_refused_reload(self.run_dir / "metrics")
            notify.ready(f"serving {len(self.config.zones)} zone(s) with {self.count} workers")
            return
        if worker_count(new.workers) != self.count:
            log.warning(
                "workers changes take effect only after a restart",
                extra={"running": self.count, "configured": worker_count(new.workers)},
            )
        if self.table is not None and 2 * new.limits.max_connections > self.table.slots:
            # Every worker maps the table at the size it was given at start.
            log.warning(
                "limits.max_connections beyond the shared connection table takes full effect "
                "only after a restart: more distinct client addresses than it holds are refused",
                extra={"addresses": self.table.slots, "configured": new.limits.max_connections},
            )
        staged = self.run_dir / "config.yaml.new"
        staged.write_text(text)
        os.replace(staged, self.run_dir / "config.yaml")
        self.config = new
        for slot in self.slots:
            if slot.proc is not None and slot.ready:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGUSR1)
            elif slot.proc is not None:
                slot.reload_pending = True
        log.info("config reload sent to every worker", extra={"workers": self.count})
        notify.ready(f"serving {len(new.zones)} zone(s) with {self.count} workers")


def supervise(config: Config, config_path: Path) -> int:
    for path in remove_leftovers():
        log.warning("removed the run directory of a supervisor that is gone", extra={"path": str(path)})
    run_dir = RunDir.create()
    try:
        supervisor = Supervisor(config, config_path, run_dir.path, run_dir.lock_fd)
        supervisor.prepare()
        return supervisor.run()
    finally:
        run_dir.remove()
