"""Prometheus metrics and health endpoints on their own loopback HTTP listener.

prometheus_client does the exposition format; the HTTP side is a few lines of asyncio so
that /readyz can ask the store (an async call) on the same event loop as everything else.
Label values are bounded: zones come from the config, decisions and classes from code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from smtpguard.policy.breaker import Circuit
from smtpguard.policy.ledger import State

log = logging.getLogger("smtpguard.metrics")

_CIRCUIT_VALUE = {Circuit.CLOSED: 0, Circuit.HALF_OPEN: 1, Circuit.OPEN: 2}
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.submissions = Counter(
            "smtpguard_submissions",
            "Submissions by zone and decision",
            ["zone", "decision"],
            registry=r,
        )
        self.submission_latency = Histogram(
            "smtpguard_submission_latency_seconds",
            "End of DATA to reply",
            ["zone"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_replies = Counter(
            "smtpguard_upstream_replies",
            "Upstream attempts by provider and reply class",
            ["provider", "class"],
            registry=r,
        )
        self.upstream_latency = Histogram(
            "smtpguard_upstream_latency_seconds",
            "One upstream attempt, connect to reply",
            ["provider"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.breaker_state = Gauge(
            "smtpguard_breaker_state",
            "Circuit per provider: 0 closed, 1 half-open, 2 open",
            ["provider"],
            registry=r,
        )
        self.provider_ready = Gauge(
            "smtpguard_provider_ready",
            "1 when the provider's last probe (connect, EHLO, STARTTLS, AUTH, QUIT) passed, else 0",
            ["provider"],
            registry=r,
        )
        self.cap_remaining = Gauge(
            "smtpguard_cap_remaining",
            "Sends left in the zone's cap window",
            ["zone", "window"],
            registry=r,
        )
        self.provider_events = Counter(
            "smtpguard_provider_events",
            "Provider events (webhooks, DSNs) by source, type and outcome",
            ["source", "type", "outcome"],
            registry=r,
        )
        self.records = Gauge(
            "smtpguard_ledger_records",
            "Ledger records per zone and state",
            ["zone", "state"],
            registry=r,
        )
        self.connections = Gauge(
            "smtpguard_connections",
            "Open client connections",
            registry=r,
        )

    def submission(self, zone: str, decision: str, seconds: float) -> None:
        self._child(self.submissions, zone, decision).inc()
        if seconds:
            self._child(self.submission_latency, zone).observe(seconds)

    def upstream(self, provider: str, reply_class: str, seconds: float) -> None:
        self._child(self.upstream_replies, provider, reply_class).inc()
        self._child(self.upstream_latency, provider).observe(seconds)

    def ledger_records(self, zone: str, counts: dict[str, int]) -> None:
        for state in State:
            self.records.labels(zone, state.value).set(counts.get(state.value, 0))

    def provider_event(self, source: str, kind: str, outcome: str) -> None:
        self._child(self.provider_events, source, kind, outcome).inc()

    def _child(self, metric: Any, *labels: str) -> Any:
        # prometheus_client's labels() validates and locks on every call; per message it
        # cost more than the increment. Children are stable, so they are looked up once.
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def circuit(self, provider: str, circuit: Circuit) -> None:
        self.breaker_state.labels(provider).set(_CIRCUIT_VALUE[circuit])

    def render(self) -> bytes:
        data: bytes = generate_latest(self.registry)
        return data


class HealthServer:
    """GET /metrics, /healthz (process up), /readyz (store reachable, a provider usable)."""

    def __init__(self, metrics: Metrics, ready: Callable[[], Awaitable[tuple[bool, str]]]) -> None:
        self.metrics = metrics
        self.ready = ready
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            # Drain the headers; nothing in them matters here.
            while (line := await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
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
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()
