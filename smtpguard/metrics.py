"""Prometheus metrics and health endpoints on their own loopback HTTP listener.

prometheus_client does the exposition format; the HTTP side is a few lines of asyncio so
that /readyz can ask the store (an async call) on the same event loop as everything else.
Label values are bounded: zones come from the config, decisions and classes from code.
Every name here is listed in docs/runbook.md; tests/ops/test_metrics.py checks the docs against a
real /metrics, so a renamed metric cannot leave the runbook behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import platform
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, NamedTuple, get_args, get_type_hints

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from smtpguard import __version__
from smtpguard.admission import Admission, peer_ip
from smtpguard.closing import close_server
from smtpguard.config import SideListenerLimits
from smtpguard.policy import http_trust
from smtpguard.policy.breaker import Circuit
from smtpguard.policy.ledger import State

log = logging.getLogger("smtpguard.metrics")

# A `_created` series per counter and histogram child doubles the series count and carries
# nothing a rate() needs.
disable_created_metrics()  # type: ignore[no-untyped-call]

_CIRCUIT_VALUE = {Circuit.CLOSED: 0, Circuit.HALF_OPEN: 1, Circuit.OPEN: 2}
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip
"""Up to past the longest provider timeout (DATA, 120 s by default): a hung provider shows
up in the top buckets instead of vanishing into +Inf."""


RELOADS_HELP = "SIGHUP reloads by result (applied or refused)"


def count_refused_reload(multiprocess: Path) -> None:
    """`workers: N`: the supervisor refuses a file before any worker sees it, so no worker
    counts that refusal. The supervisor (no registry, no event loop) adds it to a counter
    file of its own in the multiprocess directory, which every worker's scrape sums with
    the rest: smtpguard_config_reloads_total{result="refused"} means the same at any N."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    values = MmapedDict(str(multiprocess / f"counter_{os.getpid()}.db"))  # type: ignore[no-untyped-call]
    try:
        name = "smtpguard_config_reloads"
        key = mmap_key(name, f"{name}_total", ["result"], ["refused"], RELOADS_HELP)
        value, _ = values.read_value(key)  # type: ignore[no-untyped-call]
        values.write_value(key, value + 1, 0.0)  # type: ignore[no-untyped-call]
    finally:
        values.close()  # type: ignore[no-untyped-call]


_SCRAPE_LOCK = ".scrape.lock"


@contextlib.contextmanager
def _scrape_lock(multiprocess: Path, exclusive: bool) -> Iterator[None]:
    """Scrapes (shared) against folding a dead worker's files (exclusive): a scrape must see
    a dead worker's counts exactly once, never in both its file and the archive, nor in
    neither (either would read as a counter going back, which Prometheus takes for a reset)."""
    fd = os.open(multiprocess / _SCRAPE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def fold_dead_worker(multiprocess: Path, pid: int) -> None:
    """Add a dead worker's counters and histograms into one archive file per type, and
    remove its own. Its counts must go on counting, but every scrape reads every file: kept
    per pid, each restart would add two files and a scrape after a thousand restarts took
    1.7 s of a worker's event loop. (Its live* gauges are removed by mark_process_dead.)"""
    from prometheus_client.mmap_dict import MmapedDict

    with _scrape_lock(multiprocess, exclusive=True):
        for typ in ("counter", "histogram"):
            dead = multiprocess / f"{typ}_{pid}.db"
            if not dead.exists():
                continue
            archive = MmapedDict(str(multiprocess / f"{typ}_archive.db"))  # type: ignore[no-untyped-call]
            try:
                for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(str(dead)):  # type: ignore[no-untyped-call]
                    total, _ = archive.read_value(key)  # type: ignore[no-untyped-call]
                    archive.write_value(key, total + value, timestamp)  # type: ignore[no-untyped-call]
            finally:
                archive.close()  # type: ignore[no-untyped-call]
            dead.unlink()


class _Series(NamedTuple):
    """One series of Metrics, declared on the class as
    `attr: Annotated[Kind, name, documentation, labels, options]`: each Metrics creates it,
    of that kind, in its own registry, in the order declared (the order /metrics lists
    them). Options are a histogram's buckets, a gauge's multiprocess_mode."""

    attr: str
    kind: Callable[..., Any]
    name: str
    documentation: str
    labels: Sequence[str] = ()
    options: Mapping[str, Any] = MappingProxyType({})


class Metrics:
    """Each gauge names how workers' values add up (`multiprocess_mode`, used only under
    `workers: N`, where prometheus_client keeps one file of values per worker process):
    live* modes forget a worker once the supervisor marks it dead; counters and histograms
    are summed over every worker that ever ran, so a killed worker's sends still count."""

    submissions: Annotated[
        Counter, "smtpguard_submissions", "Submissions by zone and decision", ("zone", "decision")
    ]
    submission_latency: Annotated[
        Histogram,
        "smtpguard_submission_latency_seconds",
        "End of DATA to reply, by zone and decision",
        ("zone", "decision"),
        {"buckets": _LATENCY_BUCKETS},
    ]
    upstream_replies: Annotated[
        Counter,
        "smtpguard_upstream_replies",
        "Upstream attempts by provider and reply class",
        ("provider", "class"),
    ]
    upstream_latency: Annotated[
        Histogram,
        "smtpguard_upstream_latency_seconds",
        "One upstream attempt, connect to reply",
        ("provider",),
        {"buckets": _LATENCY_BUCKETS},
    ]
    breaker_state: Annotated[
        Gauge,
        "smtpguard_breaker_state",
        "Circuit per provider: 0 closed, 1 half-open, 2 open",
        ("provider",),
        {"multiprocess_mode": "livemax"},  # each worker has its own breaker: the worst one
    ]
    provider_ready: Annotated[
        Gauge,
        "smtpguard_provider_ready",
        "1 when the provider's last probe (connect, EHLO, STARTTLS, AUTH, QUIT) passed, else 0",
        ("provider",),
        {"multiprocess_mode": "livemin"},  # ready only when every worker's probe passed
    ]
    provider_throttled: Annotated[
        Gauge,
        "smtpguard_provider_throttled",
        "1 while the provider is throttled fleet-wide after a rate-limit reply, else 0",
        ("provider",),
        {"multiprocess_mode": "livemax"},  # a fleet-wide flag: throttled if any worker has seen it
    ]
    provider_rate_limited: Annotated[
        Counter,
        "smtpguard_provider_rate_limited",
        "Rate-limit replies (421, 451 4.7.x rate/too many) this instance got, by provider",
        ("provider",),
    ]
    cap_remaining: Annotated[
        Gauge,
        "smtpguard_cap_remaining",
        "Sends left in the zone's cap window",
        ("zone", "window"),
        {"multiprocess_mode": "livemax"},  # the store's count, exported by worker 0 alone
    ]
    cap_used_ratio: Annotated[
        Gauge,
        "smtpguard_cap_used_ratio",
        "Share of the zone's cap used (0..1), by the whole fleet: window hour or month",
        ("zone", "window"),
        {"multiprocess_mode": "livemax"},  # the store's count: the freshest read is the highest
    ]
    provider_events: Annotated[
        Counter,
        "smtpguard_provider_events",
        "Provider events (webhooks, DSNs) by source, type and outcome",
        ("source", "type", "outcome"),
    ]
    verdicts: Annotated[
        Counter,
        "smtpguard_verdicts",
        "Looks at a provider's log about an unknown outcome (DESIGN.md §19), by provider and verdict",
        ("provider", "verdict"),
    ]
    verdict_api_errors: Annotated[
        Counter,
        "smtpguard_verdict_api_errors",
        "Failed requests to a provider's log API, by provider and kind "
        "(auth, rate_limited, server, network, malformed, refused, unavailable)",
        ("provider", "kind"),
    ]
    records: Annotated[
        Gauge,
        "smtpguard_ledger_records",
        "Ledger records per zone and state",
        ("zone", "state"),
        {"multiprocess_mode": "livemax"},  # the store's count, exported by worker 0 alone
    ]
    connections: Annotated[
        Gauge, "smtpguard_connections", "Open client connections", (), {"multiprocess_mode": "livesum"}
    ]
    auth_failures: Annotated[
        Counter, "smtpguard_auth_failures", "Failed AUTH attempts (wrong user or password)"
    ]
    auth_lockouts: Annotated[
        Counter, "smtpguard_auth_lockouts", "Connections closed because their client IP failed AUTH too often"
    ]
    store_errors: Annotated[
        Counter,
        "smtpguard_store_errors",
        "Store calls that failed (answered 451 4.3.0 or retried), by where",
        ("where",),
    ]
    queue_depth: Annotated[
        Gauge,
        "smtpguard_queue_depth",
        "Store-and-forward entries waiting or held, by zone and class",
        ("zone", "class"),
        {"multiprocess_mode": "livemax"},  # the store's count, exported by worker 0 alone
    ]
    outbox_rows: Annotated[
        Gauge,
        "smtpguard_outbox_rows",
        "Rows of each outbox source by state (DESIGN.md §20)",
        ("source", "state"),
        {"multiprocess_mode": "livemax"},  # the table's count, exported by worker 0 alone
    ]
    outbox_lag: Annotated[
        Gauge,
        "smtpguard_outbox_lag_seconds",
        "Age of the oldest pending row of each outbox source (0 when none is pending)",
        ("source",),
        {"multiprocess_mode": "livemax"},
    ]
    synchronous: Annotated[
        Gauge,
        "smtpguard_store_synchronous",
        "1 while a synchronous standby of the PostgreSQL store is streaming, 0 while none is; "
        "absent where the store's role may not read pg_stat_replication (pg_monitor)",
        ("store",),
        {"multiprocess_mode": "livemax"},  # the store's state, exported by worker 0 alone
    ]
    reloads: Annotated[Counter, "smtpguard_config_reloads", RELOADS_HELP, ("result",)]
    cert_expiry: Annotated[
        Gauge,
        "smtpguard_tls_certificate_expiry_timestamp_seconds",
        "notAfter of the listeners' TLS certificate, as a Unix time",
        (),
        {"multiprocess_mode": "livemin"},  # the soonest expiry any worker serves
    ]
    draining: Annotated[
        Gauge,
        "smtpguard_draining",
        "1 while the instance stops: no new connections, in-flight submissions finish",
        (),
        {"multiprocess_mode": "livemax"},
    ]
    receiver_sends: Annotated[
        Counter,
        "smtpguard_receiver_sends",
        "Recipients relayed, by zone and receiving provider (DESIGN.md §21)",
        ("zone", "receiver"),
    ]
    receiver_events: Annotated[
        Counter,
        "smtpguard_receiver_events",
        "Provider events by zone, receiving provider and type (delivered, deferred, bounce, complaint)",
        ("zone", "receiver", "type"),
    ]
    receiver_alert: Annotated[
        Gauge,
        "smtpguard_receiver_alert",
        "1 while a receiver's alert rate is crossed in its current window, else 0",
        ("zone", "receiver", "kind"),
        {"multiprocess_mode": "livemax"},
    ]

    def __init__(self, multiprocess: Path | None = None) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.multiprocess = multiprocess
        """The multiprocess directory of `workers: N`; None: this process's values only."""
        self._depth_labels: set[tuple[str, str]] = set()
        self._unprobed: set[str] = set()
        """Providers whose smtpguard_provider_ready a reload forgot (gone, or changed and
        not probed since). Multiprocess files cannot forget a value: the scrape hides it,
        and any provider not configured (another worker's file may still hold one a
        reload removed before this worker started)."""
        self._configured: set[str] | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        for s in _SERIES:
            setattr(self, s.attr, s.kind(s.name, s.documentation, s.labels, registry=r, **s.options))
        if multiprocess is not None:
            # What a scrape of any worker renders: every worker's files, added up. Process
            # and platform collectors describe one process only, so they are left out.
            from prometheus_client.multiprocess import MultiProcessCollector

            r = self._rendered = CollectorRegistry()
            summed = MultiProcessCollector(None, path=str(multiprocess))  # type: ignore[no-untyped-call]
            r.register(_Unready(summed, self._shown))
        else:
            self._rendered = r
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
        Info("smtpguard_build", "smtpguard version and Python it runs on", registry=r).info(
            {"version": __version__, "python": platform.python_version()}
        )

    def submission(self, zone: str, decision: str, seconds: float) -> None:
        self._child(self.submissions, zone, decision).inc()
        if seconds:
            self._child(self.submission_latency, zone, decision).observe(seconds)

    def upstream(self, provider: str, reply_class: str, seconds: float) -> None:
        self._child(self.upstream_replies, provider, reply_class).inc()
        self._child(self.upstream_latency, provider).observe(seconds)

    def outbox(self, source: str, counts: Mapping[str, int], lag: float | None) -> None:
        for state, n in counts.items():
            self.outbox_rows.labels(source, state).set(n)
        self.outbox_lag.labels(source).set(lag or 0.0)

    def queue_depths(self, depth: Mapping[tuple[str, str], int]) -> None:
        if self.multiprocess is None:
            self.queue_depth.clear()
        else:
            # A cleared child would keep its last value in this worker's file: say 0.
            for gone in self._depth_labels - set(depth):
                self.queue_depth.labels(*gone).set(0)
            self._depth_labels = set(depth)
        for (zname, lane), n in depth.items():
            self.queue_depth.labels(zname, lane).set(n)

    def store_synchronous(self, synchronous: bool | None) -> None:
        if synchronous is None:
            with contextlib.suppress(KeyError):
                self.synchronous.remove("postgresql")
            return
        self.synchronous.labels("postgresql").set(1 if synchronous else 0)

    def ledger_records(self, zone: str, counts: dict[str, int]) -> None:
        for state in State:
            self.records.labels(zone, state.value).set(counts.get(state.value, 0))

    def provider_event(self, source: str, kind: str, outcome: str) -> None:
        self._child(self.provider_events, source, kind, outcome).inc()

    def verdict(self, provider: str, verdict: str) -> None:
        self._child(self.verdicts, provider, verdict).inc()

    def verdict_api_error(self, provider: str, kind: str, n: int) -> None:
        self._child(self.verdict_api_errors, provider, kind).inc(n)

    def receiver_sent(self, zone: str, receiver: str, n: int = 1) -> None:
        self._child(self.receiver_sends, zone, receiver).inc(n)

    def receiver_event(self, zone: str, receiver: str, kind: str) -> None:
        self._child(self.receiver_events, zone, receiver, kind).inc()

    def _child(self, metric: Any, *labels: str) -> Any:
        # prometheus_client's labels() validates and locks on every call; per message it
        # cost more than the increment. Children are stable, so they are looked up once.
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def event(self, name: str) -> None:
        """A listener event with no zone yet: auth_failure, auth_lockout, store_error:<where>."""
        if name == "auth_failure":
            self.auth_failures.inc()
        elif name == "auth_lockout":
            self.auth_lockouts.inc()
        elif name.startswith("store_error:"):
            self._child(self.store_errors, name.split(":", 1)[1]).inc()

    def circuit(self, provider: str, circuit: Circuit) -> None:
        self.breaker_state.labels(provider).set(_CIRCUIT_VALUE[circuit])

    def throttled(self, provider: str, throttled: bool) -> None:
        self._child(self.provider_throttled, provider).set(1 if throttled else 0)

    def rate_limited(self, provider: str) -> None:
        self._child(self.provider_rate_limited, provider).inc()

    def provider(self, name: str) -> None:
        """Expose a configured provider's throttling series from the start, at 0."""
        self._child(self.provider_rate_limited, name)
        self._child(self.provider_throttled, name)  # 0 when new; a known value is kept

    def configured(self, providers: set[str]) -> None:
        self._configured = providers

    def _shown(self, provider: str) -> bool:
        return provider not in self._unprobed and (self._configured is None or provider in self._configured)

    def probed(self, provider: str, ready: bool) -> None:
        self._unprobed.discard(provider)
        self.provider_ready.labels(provider).set(1 if ready else 0)

    def forget_probe(self, provider: str) -> None:
        """Gone or changed at a reload: no stale 1 in smtpguard_provider_ready until it is
        probed again."""
        with contextlib.suppress(KeyError):
            self.provider_ready.remove(provider)
        if self.multiprocess is not None:
            self._unprobed.add(provider)

    def render(self) -> bytes:
        if self.multiprocess is None:
            data: bytes = generate_latest(self._rendered)
            return data
        with _scrape_lock(self.multiprocess, exclusive=False):
            data = generate_latest(self._rendered)
        return data


_SERIES = [
    _Series(attr, *get_args(hint)) for attr, hint in get_type_hints(Metrics, include_extras=True).items()
]
"""Every series Metrics declares, as Metrics.__init__ creates them."""


class _Unready:
    """The multiprocess sum with only the smtpguard_provider_ready samples of the providers
    `shown` accepts (Metrics.forget_probe)."""

    def __init__(self, inner: Any, shown: Callable[[str], bool]) -> None:
        self.inner = inner
        self.shown = shown

    def collect(self) -> Iterator[Any]:
        for metric in self.inner.collect():
            if metric.name == "smtpguard_provider_ready":
                metric.samples = [s for s in metric.samples if self.shown(s.labels.get("provider", ""))]
            yield metric


_LIMITS = SideListenerLimits(max_connections=128, max_connections_per_ip=32, read_timeout=5.0)
"""The metrics listener takes no authentication and shares the process's descriptors with
the SMTP listener: a scrape or a health check holds a connection for one request, so its
connections are capped (a connection over a cap is closed at accept) and a request has 5 s
from accept to its last header, an answer 5 s to be taken; a client trickling header lines
held its connection for good, and 600 of them left SMTP unable to accept."""
_LOCAL_LIMITS = SideListenerLimits(max_connections=32, max_connections_per_ip=32, read_timeout=5.0)
"""Loopback's own share, outside the total: four remote addresses holding 32 connections
each fill the 128, and a health check from this host (`smtpguard healthcheck`, the
container's HEALTHCHECK, a local agent) must still be answered."""


class HealthServer:
    """GET /metrics, /healthz (process up), /readyz (store reachable, a provider usable)."""

    def __init__(self, metrics: Metrics, ready: Callable[[], Awaitable[tuple[bool, str]]]) -> None:
        self.metrics = metrics
        self.ready = ready
        self._server: asyncio.Server | None = None
        self.port = 0
        self.admission = Admission(_LIMITS, "metrics", log.name)
        self.local = Admission(_LOCAL_LIMITS, "metrics (loopback)", log.name)

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> None:
        if sock is not None:  # a worker's socket in the supervisor's group (workers: N)
            self._server = await asyncio.start_server(self._serve, sock=sock)
        else:
            self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            await close_server(self._server)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ip = peer_ip(writer.transport)
        peer = http_trust.address(ip)
        gate = self.local if peer is not None and peer.is_loopback else self.admission
        bucket = gate.admit(ip)
        if bucket is None:
            writer.transport.abort()
            return
        try:
            async with asyncio.timeout(_LIMITS.read_timeout):
                request = await reader.readline()
                # Drain the headers; nothing in them matters here.
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    if len(line) > 8192:
                        break
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, self.metrics.render()
            elif path == "/healthz":
                status, ctype, body = "200 OK", "text/plain", b"ok\n"
            elif path == "/readyz":
                ok, why = await self.ready()
                status = "200 OK" if ok else "503 Service Unavailable"
                ctype, body = "text/plain", (why + "\n").encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            writer.write(head + (body if parts and parts[0] != "HEAD" else b""))
            async with asyncio.timeout(_LIMITS.read_timeout):
                await writer.drain()
        except TimeoutError:
            writer.transport.abort()  # an answer not taken: close() would wait for the reader
        except (ConnectionError, UnicodeDecodeError, ValueError):
            pass  # ValueError: a line over the reader's 64 KiB limit
        finally:
            gate.release(bucket)
            writer.close()


def _loopback(host: str) -> str:
    """Where a check on this machine reaches a listener bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


async def local_health(
    listen: Sequence[tuple[str, int, str]], metrics: tuple[str, int] | None, timeout: float = 4.0
) -> tuple[bool, str]:
    """The container HEALTHCHECK (`smtpguard healthcheck`): /healthz when `metrics:` is set,
    else the first listener's SMTP greeting (a 220), so the check works either way."""
    try:
        if metrics is not None:
            host, port = metrics
            reader, writer = await asyncio.wait_for(asyncio.open_connection(_loopback(host), port), timeout)
            try:
                writer.write(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n")
                await writer.drain()
                status = await asyncio.wait_for(reader.readline(), timeout)
            finally:
                writer.close()
            ok = status.split()[1:2] == [b"200"]
            return ok, f"/healthz on {host}:{port}: {status.decode('latin-1').strip() or 'no answer'}"
        host, port, tls = listen[0]
        ctx = None
        if tls == "implicit":
            import ssl

            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE  # the greeting is checked, not the certificate
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(_loopback(host), port, ssl=ctx), timeout
        )
        try:
            greeting = await asyncio.wait_for(reader.readline(), timeout)
            writer.write(b"QUIT\r\n")
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        finally:
            writer.close()
        text = greeting.decode("latin-1").strip()
        return text.startswith("220"), f"SMTP greeting on {host}:{port}: {text or 'none'}"
    except (OSError, TimeoutError) as e:
        return False, f"no answer: {e}"
