"""Shared parts of the benchmarks: free ports, child processes stopped by PID, memory readings,
the upstream sink, redis-server, a private Postfix relay and smtpguard configs.

Every server is bound to 127.0.0.1 on a free port, started as a child of the bench, and
stopped by its PID (terminate, then kill after a bounded wait).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PY = sys.executable

ZONE = "bench"
USER = "bench-app"
PASSWORD = "bench-password-not-secret"
SENDER = "billing@bench.example"
RECIPIENT = "customer@example.com"
HUGE_CAP = 100_000_000


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port not handed out before in this process: a port-0 binding may be
    given a just-closed port again, so two calls in a row can return one number (the
    suite's own helper did; tests/support/ports.py keeps the suite's servers apart further)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_port(port: int, timeout: float = 20.0, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}: {proc.tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def install_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` stops the servers it started."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def raise_nofile(want: int) -> int:
    """Raise the soft open-files limit towards `want` (bounded by the hard limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --- child processes -------------------------------------------------------------------------
class Proc:
    """A child process with its output in a log file; stop() ends it by PID."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        stdout_pipe: bool = False,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if stdout_pipe else self._log,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=str(cwd or ROOT),
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 1500) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        with contextlib.suppress(Exception):
            if self.popen.stdout is not None:
                self.popen.stdout.close()
        with contextlib.suppress(Exception):
            self._log.close()


# --- memory ----------------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of one process, in kB ({} when it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value = line.split(":", 1)
                    out[name] = int(value.split()[0])
    except OSError:
        return {}
    return out


def descendants(root: int) -> list[int]:
    """root and every process below it (by /proc/*/stat parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo and len(out) < 10_000:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(root: int) -> float:
    """CPU time (user + system) of `root`, its live descendants, and the children it has
    already reaped (for Postfix, whose master reaps short-lived daemons)."""
    total = 0.0
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is state (stat field 3): utime=14, stime=15, cutime=16, cstime=17
        total += int(fields[11]) + int(fields[12])
        if pid == root:
            total += int(fields[13]) + int(fields[14])
    return total / _TICK


def pss_mb(pids: list[int]) -> float:
    """Proportional set size summed over `pids`, in MB: shared pages (libraries, Postfix's
    shared text) counted once overall instead of once per process."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total * 1024 / 1e6


def memory_mb(pids: list[int]) -> tuple[float, float]:
    """(VmRSS, VmHWM) summed over `pids`, in MB (10^6 bytes)."""
    rss = hwm = 0
    for pid in pids:
        st = proc_status(pid)
        rss += st.get("VmRSS", 0)
        hwm += st.get("VmHWM", 0)
    return rss * 1024 / 1e6, hwm * 1024 / 1e6


# --- the upstream sink -----------------------------------------------------------------------
_MESG = re.compile(rb"mesg=(\d+)")


class Sink:
    """Postfix's smtp-sink when installed (`-c` counters), else bench/sink.py (same counters)."""

    def __init__(self, tmp: Path, force_python: bool = False) -> None:
        self.port = free_port()
        exe = shutil.which("smtp-sink")
        if exe is None and Path("/usr/sbin/smtp-sink").exists():
            exe = "/usr/sbin/smtp-sink"
        if exe and not force_python:
            argv = [exe]
            if os.geteuid() == 0:
                argv += ["-u", "nobody"]
            argv += ["-c", f"127.0.0.1:{self.port}", "256"]
            self.kind = "smtp-sink"
        else:
            argv = [PY, "-m", "bench.sink", str(self.port)]
            self.kind = "python-asyncio-sink"
        self.proc = Proc("sink", argv, tmp / "sink.log", stdout_pipe=True)
        self._count = 0
        self._changed_at = time.perf_counter()
        self._tail = b""
        self.min_quiet = 0.0
        """A floor under settled_count's `quiet`: a relay that queues (Postfix) delivers in bursts."""
        self._reader = threading.Thread(target=self._read, name="sink-counters", daemon=True)
        self._reader.start()
        wait_port(self.port, 10, self.proc)

    def _read(self) -> None:
        out = self.proc.popen.stdout
        assert out is not None
        while True:
            try:
                chunk = os.read(out.fileno(), 65536)
            except OSError:
                return
            if not chunk:
                return
            buf = self._tail + chunk
            found = _MESG.findall(buf)
            if found:
                count = int(found[-1])
                if count != self._count:
                    self._changed_at = time.perf_counter()
                    self._count = count
            self._tail = buf[-64:]

    def count(self) -> int:
        return self._count

    @property
    def changed_at(self) -> float:
        """time.perf_counter() when the message count last moved (as read from the sink's
        counters, so it lags the sink by the pipe read: well under a millisecond)."""
        return self._changed_at

    def wait_for(self, target: int, timeout: float) -> bool:
        """Poll (every 10 ms, bounded by `timeout`) until the count reaches `target`."""
        deadline = time.monotonic() + timeout
        while self._count < target and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._count >= target

    def settled_count(self, quiet: float = 0.3, timeout: float = 30.0) -> int:
        """The count once it has not moved for `quiet` seconds (at least min_quiet; bounded
        by `timeout`)."""
        quiet = max(quiet, self.min_quiet)
        deadline = time.monotonic() + timeout
        last, since = self._count, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = self._count
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                break
        return self._count

    def stop(self) -> None:
        self.proc.stop()


# --- redis-server ----------------------------------------------------------------------------
class Redis:
    """A private redis-server: no RDB snapshots, `appendonly no` (durability is not what the
    relay bench compares; smtpguard's docs ask for appendfsync always in production)."""

    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.port = free_port()
        d = tmp / "redis"
        d.mkdir(exist_ok=True)
        self.proc = Proc(
            "redis-server",
            [
                exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--dir", str(d),
            ],
            tmp / "redis.log",
        )  # fmt: skip
        wait_port(self.port, 10, self.proc)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def used_memory(self) -> int:
        import redis

        r = redis.Redis(host="127.0.0.1", port=self.port)
        try:
            return int(r.info("memory")["used_memory"])
        finally:
            r.close()

    def stop(self) -> None:
        self.proc.stop()


# --- PostgreSQL ------------------------------------------------------------------------------
class Postgres:
    """A private PostgreSQL (initdb in the bench's folder, a loopback port) with the settings
    a deployment keeps: fsync and synchronous_commit on. The server refuses to run as root,
    so as root it runs as the `postgres` user (else `nobody`), which owns its folder."""

    def __init__(self, tmp: Path) -> None:
        import pwd

        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
        if not bins:
            raise RuntimeError("PostgreSQL is not installed")
        self.bin = bins[0].parent
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            for name in ("postgres", "nobody"):
                with contextlib.suppress(KeyError):
                    pwd.getpwnam(name)
                    self.user = name
                    break
        # The bench's folder may be private to root: one of its own under /tmp.
        self.dir = Path(tempfile.mkdtemp(prefix="smtpguard-bench-pg-"))
        self.dir.chmod(0o755)
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        self.data = self.dir / "data"
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")  # fmt: skip
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\nmax_connections = 200\n"
                "shared_buffers = 128MB\n"
            )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "start")
        wait_port(self.port, 20)

    def _run(self, tool: str, *args: str) -> None:
        argv = [str(self.bin / tool), *args]
        if self.user is not None:
            argv = ["runuser", "-u", self.user, "--", *argv]
        subprocess.run(argv, check=True, capture_output=True, timeout=60, cwd=self.dir)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


def start_store(store: str, tmp: Path, name: str, stop: list[Any], pg: Postgres | None = None) -> str:
    """The URL of a fresh `store` (sqlite, redis, postgres) for smtpguard, its server started
    and appended to `stop`: a SQLite file tmp/NAME.db, a private redis-server, or a private
    PostgreSQL; with `pg`, a database NAME created in that server instead of another server."""
    if store == "sqlite":
        return f"sqlite:///{tmp / f'{name}.db'}"
    if store == "redis":
        redis = Redis(tmp)
        stop.append(redis)
        return redis.url
    if store == "postgres":
        if pg is None:
            pg = Postgres(tmp)
            stop.append(pg)
            return pg.url
        import psycopg

        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"'.encode())
        return pg.url.rsplit("/", 1)[0] + "/" + name
    raise ValueError(store)


# --- a private Postfix relay -----------------------------------------------------------------
_MASTER_CF = """\
{port} inet n - n - - smtpd
pickup    unix  n       -       n       60      1       pickup
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
proxywrite unix -       -       n       -       1       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
local     unix  -       n       n       -       -       local
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
"""


# What a relay operator changes from Postfix's defaults for a relay-only host: smtpd no longer
# waits (in_flow_delay, 1 s by default) when the queue manager lags, and the smtp client
# keeps its connections to the relayhost open between deliveries instead of one TCP and
# SMTP handshake per message (smtp_connection_cache_destinations; the on-demand cache
# only caches while a destination has a backlog).
def tuned_settings(relayhost: str) -> dict[str, str]:
    return {
        "in_flow_delay": "0",
        "default_process_limit": "200",
        "smtp_connection_cache_on_demand": "yes",
        "smtp_connection_cache_destinations": relayhost,
    }


class Postfix:
    """A private Postfix instance (its own config, queue and log under `tmp`) relaying every
    message to the sink. Clients from 127.0.0.1 relay without AUTH (mynetworks). Runs with
    `postfix start-fg`, so the master daemon is our child and is stopped by its PID.
    `tuned`: tuned_settings() on top (bench.cores' postfix-tuned row)."""

    def __init__(self, tmp: Path, sink_port: int, tuned: bool = False) -> None:
        if shutil.which("postfix") is None and not Path("/usr/sbin/postfix").exists():
            raise RuntimeError("postfix is not installed")
        self.port = free_port()
        self.dir = tmp / "postfix"
        conf = self.dir / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        for p in (tmp, self.dir):
            p.chmod(0o755)
        (self.dir / "queue").mkdir(exist_ok=True)
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        with contextlib.suppress(KeyError, PermissionError):
            import pwd

            pw = pwd.getpwnam("postfix")
            os.chown(data, pw.pw_uid, pw.pw_gid)
        main = {
            "compatibility_level": "3.6",
            "queue_directory": str(self.dir / "queue"),
            "data_directory": str(self.dir / "data"),
            "meta_directory": "/etc/postfix",
            "myhostname": "bench-postfix.invalid",
            "mydomain": "invalid",
            "myorigin": "bench-postfix.invalid",
            "mydestination": "",
            "relay_domains": "",
            "local_recipient_maps": "",
            "alias_maps": "",
            "alias_database": "",
            "mynetworks": "127.0.0.0/8",
            "inet_interfaces": "127.0.0.1",
            "inet_protocols": "ipv4",
            "relayhost": f"[127.0.0.1]:{sink_port}",
            "smtp_dns_support_level": "disabled",
            "smtpd_relay_restrictions": "permit_mynetworks, reject_unauth_destination",
            "smtpd_recipient_restrictions": "permit_mynetworks, reject",
            "smtp_tls_security_level": "none",
            "smtpd_tls_security_level": "none",
            "maillog_file": str(self.dir / "maillog"),
            "maillog_file_prefixes": str(self.dir),
            "biff": "no",
            "smtputf8_enable": "no",
            "default_process_limit": "200",
            "smtpd_client_connection_count_limit": "0",
            "master_service_disable": "",
        }
        if tuned:
            main |= tuned_settings(main["relayhost"])
        (conf / "main.cf").write_text("".join(f"{k} = {v}\n" for k, v in main.items()))
        (conf / "master.cf").write_text(_MASTER_CF.format(port=f"127.0.0.1:{self.port}"))
        exe = shutil.which("postfix") or "/usr/sbin/postfix"
        # `postfix check` creates the queue's subdirectories with their owners; then the
        # master daemon runs in the foreground (-s) as our own child, so its PID is ours.
        subprocess.run(
            [exe, "-c", str(conf), "check"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )
        daemon_dir = subprocess.run(
            ["postconf", "-c", str(conf), "-h", "daemon_directory"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
        self.proc = Proc(
            "postfix-master",
            [f"{daemon_dir}/master", "-c", str(conf), "-s"],
            tmp / "postfix.log",
            env={"MAIL_CONFIG": str(conf)},
        )
        wait_port(self.port, 30, self.proc)

    def pids(self) -> list[int]:
        return descendants(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM to the master (it ends its children), then kill any child left, by PID."""
        children = [p for p in self.pids() if p != self.proc.pid]
        self.proc.stop(20)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(proc_status(p) for p in children):
            time.sleep(0.1)
        for pid in children:
            if proc_status(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)


# --- smtpguard -------------------------------------------------------------------------------
_HASH: list[str] = []


def password_hash() -> str:
    if not _HASH:
        from smtpguard.passwords import hash_password

        _HASH.append(hash_password(PASSWORD))
    return _HASH[0]


LOG_LEVEL = "warning"
"""smtpguard's log level in every bench config (`bench.relay --log-level`): warning keeps the
decision line, one per message at info (the default), out of what is measured."""


def guard_config(
    port: int,
    upstream_port: int,
    store_url: str,
    pool_size: int,
    limits: dict[str, Any] | None = None,
    queue: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """smtpguard's bench config; with `queue` (the config's `queue` section) the zone has
    `delivery: queue` (store-and-forward) instead of the default synchronous relay."""
    cfg: dict[str, Any] = {
        "listen": [{"address": f"127.0.0.1:{port}", "tls": "none"}],
        # The bench's redis-server runs without fsync (it measures smtpguard, not the disk),
        # which serve refuses unless told the store may forget writes.
        "store": {"url": store_url, **({"unsafe": True} if store_url.startswith("redis") else {})},
        "event_key": {"header": "X-Event-Key", "inflight_wait": "10s", "lease": "30s"},
        "limits": {"max_recipients": 100, **(limits or {})},
        "providers": [
            {
                "name": "sink",
                "kind": "smtp",
                "host": "127.0.0.1",
                "port": upstream_port,
                "tls": "none",
                "pool_size": pool_size,
                "timeouts": {"connect": "5s", "command": "10s", "data": "10s"},
            }
        ],
        "hostname": "bench-guard.invalid",
        "log": {"format": "json", "level": LOG_LEVEL},
        "zones": {
            ZONE: {
                "plan": "unlimited",
                "hourly_cap": HUGE_CAP,
                "monthly_cap": HUGE_CAP,
                "missing_key": "reject",
                "senders": [SENDER],
                "users": [{"username": USER, "password_hash": password_hash()}],
            }
        },
    }
    if queue is not None:
        cfg["queue"] = queue
        cfg["zones"][ZONE]["delivery"] = "queue"
    return cfg


class Guard:
    """`python -m smtpguard serve -c CONFIG` as a child process."""

    def __init__(self, tmp: Path, name: str, config: dict[str, Any], src: Path | None = None) -> None:
        """`src`: run the smtpguard package of that source tree (an export of another commit,
        bench.relay --baseline) instead of this checkout's, with this checkout's venv."""
        self.port = int(config["listen"][0]["address"].rsplit(":", 1)[1])
        cfg_path = tmp / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
        env = {"PYTHONUNBUFFERED": "1"}
        if src is not None:
            # `python -m` puts its working directory first on sys.path, ahead of the venv's
            # editable install of this checkout.
            env["PYTHONPATH"] = str(src)
        self.proc = Proc(
            "smtpguard",
            [PY, "-m", "smtpguard", "serve", "-c", str(cfg_path)],
            tmp / f"{name}.log",
            env=env,
            cwd=src,
        )
        wait_port(self.port, 30, self.proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.stop(15)


# --- bookkeeping -----------------------------------------------------------------------------
@contextlib.contextmanager
def workdir(prefix: str, keep: bool = False) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)  # Postfix's daemons (user postfix) must reach their queue below it
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def machine_info() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "kernel": platform.release(),
    }


def stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{stamp()}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
