"""A real DNS server for readiness tests: NSD, authoritative for a test zone written by the
test, on a free loopback port; plus two resolvers that misbehave on purpose (SERVFAIL to
everything, and one that reads queries and never answers).

NSD rather than dnsmasq: a null MX (`MX 0 .`), NXDOMAIN inside a zone, an empty answer and
long TXT records are plain zone-file lines for an authoritative server. scripts/test
installs it (Debian's `nsd`).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.resolver

from tests.support import free_port

NSD = shutil.which("nsd") or "/usr/sbin/nsd"

ZONE_HEAD = """$ORIGIN {origin}.
$TTL {ttl}
@ IN SOA ns.{origin}. hostmaster.{origin}. 1 3600 600 86400 {negative}
@ IN NS ns.{origin}.
ns IN A 127.0.0.1
"""


def txt(value: str) -> str:
    """A TXT rdata in zone-file syntax, split in 255-octet strings (RFC 1035 §3.3.14)."""
    parts = [value[i : i + 255] for i in range(0, len(value), 255)] or [""]
    return " ".join('"' + p.replace("\\", "\\\\").replace('"', '\\"') + '"' for p in parts)


class NsdServer:
    """NSD serving one zone (`origin`) from `records` (zone-file lines relative to it)."""

    def __init__(self, tmp: Path, origin: str, records: list[str], ttl: int = 300, negative: int = 300):
        self.dir = tmp / f"nsd-{origin}"
        self.origin = origin
        self.records = records
        self.ttl = ttl
        self.negative = negative
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        if not Path(NSD).exists():
            raise RuntimeError("nsd is not installed (scripts/test installs it)")
        self.dir.mkdir(parents=True, exist_ok=True)
        zone = ZONE_HEAD.format(origin=self.origin, ttl=self.ttl, negative=self.negative)
        (self.dir / "zone").write_text(zone + "\n".join(self.records) + "\n")
        d = self.dir
        (d / "nsd.conf").write_text(
            f"""server:
  ip-address: 127.0.0.1
  port: {self.port}
  username: ""
  chroot: ""
  zonesdir: "{d}"
  database: ""
  pidfile: "{d}/nsd.pid"
  xfrdfile: "{d}/xfrd.state"
  zonelistfile: "{d}/zone.list"
  logfile: "{d}/nsd.log"
  server-count: 1
  verbosity: 1
  hide-version: yes
  # NSD limits answers to 200/s per /24 by default (response rate limiting): off on loopback
  rrl-ratelimit: 0
  rrl-whitelist-ratelimit: 0
remote-control:
  control-enable: no
zone:
  name: "{self.origin}"
  zonefile: "{d}/zone"
"""
        )
        self.proc = subprocess.Popen(
            [NSD, "-d", "-c", str(d / "nsd.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait_answering()

    def _wait_answering(self, timeout: float = 10) -> None:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = ["127.0.0.1"]
        resolver.port = self.port
        resolver.lifetime = 0.5
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = (self.dir / "nsd.log").read_text() if (self.dir / "nsd.log").exists() else ""
                raise RuntimeError(f"nsd exited: {log[-2000:]}")
            with contextlib.suppress(Exception):
                resolver.resolve(self.origin, "SOA")
                return
            time.sleep(0.05)
        raise RuntimeError(f"nsd did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class BadResolver:
    """A UDP resolver on a free loopback port that answers every query SERVFAIL, or, with
    `silent`, reads every query and never answers (a resolver that has gone away but whose
    host still takes packets). `queries` counts what arrived."""

    def __init__(self, silent: bool) -> None:
        self.silent = silent
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.queries += 1
            if self.silent:
                continue
            with contextlib.suppress(Exception):
                query = dns.message.from_wire(data)
                response = dns.message.make_response(query)
                response.set_rcode(dns.rcode.SERVFAIL)
                self.sock.sendto(response.to_wire(), peer)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


class SlowResolver:
    """A UDP resolver on a free loopback port that forwards each query to `upstream` (a
    real server, e.g. NSD) and answers after `delays[TYPE]` seconds (default `delay`); a
    type mapped to None is read and never answered. `queries` counts what arrived."""

    def __init__(self, upstream: NsdServer, delay: float, delays: dict[str, float | None] | None = None):
        self.upstream = upstream
        self.delay = delay
        self.delays = delays or {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.queries += 1
            with contextlib.suppress(Exception):
                query = dns.message.from_wire(data)
                rdtype = dns.rdatatype.to_text(query.question[0].rdtype)
                delay = self.delays.get(rdtype, self.delay)
                if delay is not None:
                    threading.Timer(delay, self._answer, (query, peer)).start()

    def _answer(self, query: dns.message.Message, peer: tuple[str, int]) -> None:
        with contextlib.suppress(Exception):
            response = dns.query.udp(query, "127.0.0.1", timeout=2, port=self.upstream.port)
            self.sock.sendto(response.to_wire(), peer)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@contextlib.contextmanager
def slow_resolver(
    upstream: NsdServer, delay: float, delays: dict[str, float | None] | None = None
) -> Iterator[SlowResolver]:
    server = SlowResolver(upstream, delay, delays)
    server._thread.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def nsd(tmp: Path, origin: str, records: list[str], **kw: int) -> Iterator[NsdServer]:
    server = NsdServer(tmp, origin, records, **kw)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def bad_resolver(silent: bool) -> Iterator[BadResolver]:
    server = BadResolver(silent)
    server.start()
    try:
        yield server
    finally:
        server.stop()
