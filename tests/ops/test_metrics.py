"""Metrics and health as an operator meets them: the names the docs give exist on a real
/metrics, /readyz turns 503 while draining, a SIGHUP re-reads the TLS certificate, and a
serve process under systemd's Type=notify says READY, RELOADING and STOPPING."""

from __future__ import annotations

import asyncio
import platform
import re
import shutil
import signal
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import aiosmtplib
import pytest
import yaml

from smtpguard import __version__
from smtpguard.config import loads
from smtpguard.server import Server
from tests.ops.test_ops import http_get
from tests.ops.test_ops import sample as labelled
from tests.support import (
    Behaviour,
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    message,
    running_guard,
    send,
    write_config,
)
from tests.support.eventually import eventually
from tests.support.hostile import RawClient, make_cert, with_starttls

ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"\b(?:smtpguard|process|python)_[a-z_]*[a-z]\b")


def sample(body: str, name: str, **labels: str) -> float:
    """One sample's value; without labels, the plain `name value` line."""
    if labels:
        return labelled(body, name, **labels)
    for line in body.splitlines():
        metric, _, value = line.partition(" ")
        if metric == name:
            return float(value)
    raise AssertionError(f"{name} not exposed")


def exposed_names(body: str) -> set[str]:
    """Every metric name a scrape can see: sample names and the HELP/TYPE names (a labelled
    metric with no child yet has only those)."""
    names: set[str] = set()
    for line in body.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line.split()[2]
            names.add(name)
            if line.startswith("# TYPE ") and line.split()[3] == "histogram":
                names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


_NOT_METRICS = {
    "smtpguard_key",
    "smtpguard_reserve",
    "smtpguard_count_unit",
    "smtpguard_claim",
    "smtpguard_schema",
    "smtpguard_outbox",
    "smtpguard_outbox_id_seq",
}
"""Names of the same shape that are not metrics: the provider variable of docs/events*.md,
the PostgreSQL store's functions and schema table of docs/stores.md, the outbox table of
docs/outbox.md and its id sequence (configuration.md)."""


def documented_names() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in _NAME.findall(doc.read_text()):
            if name not in _NOT_METRICS:
                found.setdefault(name, []).append(doc.name)
    return found


async def test_every_metric_the_docs_name_is_on_a_real_metrics_page(tmp: Path, upstream: Upstream) -> None:
    cfg = with_starttls(base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"}), tmp)
    cfg["listen"].append({"address": "127.0.0.1:0", "tls": "none"})
    async with running_guard(cfg) as guard:
        await send(guard.ports[1], message("m1"))
        assert guard.health is not None
        status, body = await http_get(guard.health.port, "/metrics")
    assert status == 200
    names = exposed_names(body)
    docs = documented_names()
    assert "smtpguard_submissions_total" in docs, "the runbook lists the metrics"
    missing = {name: where for name, where in docs.items() if name not in names}
    assert not missing, f"named in the docs but not exposed: {missing}"
    # The series prometheus_client adds by default and nobody queries.
    assert "_created" not in body
    assert sample(body, "smtpguard_build_info", version=__version__, python=platform.python_version()) == 1
    assert "process_cpu_seconds_total" in names and "python_info" in names
    # Buckets reach past the 120 s DATA timeout.
    assert 'le="120.0"' in body and 'le="300.0"' in body
    expiry = sample(body, "smtpguard_tls_certificate_expiry_timestamp_seconds")
    assert expiry > 1e9


async def test_latency_by_decision_and_auth_failures(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"})
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        assert (await send(port, message("l1"))).code == 250
        assert (await send(port, message("l1"))).code == 250
        client = await RawClient.connect(port)
        await client.reply()
        await client.ehlo()
        assert (await client.login(password="wrong")).code == 535  # one AUTH PLAIN, refused
        await client.close()
        assert guard.health is not None
        _, body = await http_get(guard.health.port, "/metrics")
    count = "smtpguard_submission_latency_seconds_count"
    assert sample(body, count, zone="acme", decision="relayed") == 1
    assert sample(body, count, zone="acme", decision="duplicate") == 1
    assert sample(body, "smtpguard_auth_failures_total") == 1
    assert sample(body, "smtpguard_draining") == 0


async def test_queue_depth_counts_waiting_entries(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"})
    cfg["zones"]["acme"]["delivery"] = "queue"
    cfg["zones"]["acme"]["paused"] = True  # held: the entry stays in the queue
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("q1"))
        assert reply.code == 250
        assert guard.health is not None
        _, body = await eventually(  # the gauges are refreshed every few seconds
            lambda: http_get(guard.health.port, "/metrics"),
            lambda r: 'smtpguard_queue_depth{class="transactional",zone="acme"}' in r[1],
            timeout=7.5,
            interval=0.05,
        )
    assert sample(body, "smtpguard_queue_depth", zone="acme", **{"class": "transactional"}) == 1


async def test_readyz_is_503_while_draining(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=1.5)
    cfg = base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"})
    server = Server(loads(yaml.safe_dump(cfg)))
    await server.start()
    assert server.health is not None
    health = server.health.port
    assert (await http_get(health, "/readyz"))[0] == 200
    pending = asyncio.create_task(send(server.ports[0], message("d1")))
    await upstream.wait_received(1)
    stopping = asyncio.create_task(server.stop())
    status, body = await eventually(
        lambda: http_get(health, "/readyz"), lambda r: r[0] == 503, timeout=1, interval=0.01
    )
    assert status == 503 and "draining" in body
    assert sample((await http_get(health, "/metrics"))[1], "smtpguard_draining") == 1
    assert not pending.done(), "the in-flight submission is still being answered"
    assert (await pending).code == 250
    await stopping


def der_of(pem: str | Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(pem).read_text())


def peer_certificate(port: int) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE

    async def get() -> bytes:
        client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False, timeout=10)
        await client.connect()
        try:
            await client.starttls(tls_context=ctx)
            assert client.transport is not None
            der: bytes = client.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
            return der
        finally:
            await client.quit()

    return asyncio.run(get())


async def test_sighup_rereads_the_tls_certificate(tmp: Path, upstream: Upstream) -> None:
    cfg = with_starttls(base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"}), tmp)
    renewed = tmp / "renewed"
    renewed.mkdir()
    new_cert, new_key = make_cert(renewed)
    path = tmp / "smtpguard.yaml"
    async with running_guard(cfg, config_path=path) as guard:
        port = guard.ports[0]
        before = await asyncio.to_thread(peer_certificate, port)
        assert before == der_of(cfg["tls"]["cert"])
        # A renewal replaces the files in place; the config is unchanged.
        shutil.copy(new_cert, cfg["tls"]["cert"])
        shutil.copy(new_key, cfg["tls"]["key"])
        assert await guard.reload()
        after = await asyncio.to_thread(peer_certificate, port)
        assert after == der_of(new_cert) and after != before
        # A broken pair is refused and the running certificate stays.
        shutil.copy(tmp / "smtpguard.yaml", cfg["tls"]["key"])  # a file, but not a key
        assert not await guard.reload()
        assert await asyncio.to_thread(peer_certificate, port) == after
        assert guard.health is not None
        _, body = await http_get(guard.health.port, "/metrics")
    assert sample(body, "smtpguard_config_reloads_total", result="applied") == 1
    assert sample(body, "smtpguard_config_reloads_total", result="refused") == 1


class NotifySocket:
    """systemd's end of NOTIFY_SOCKET (Type=notify): what a serve process tells it."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)

    async def next(self) -> dict[str, str]:
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, 4096), 15)
        return dict(line.split("=", 1) for line in data.decode().splitlines())

    def rest(self) -> list[str]:
        """What it was told and nobody read yet, without waiting."""
        said = []
        while True:
            try:
                said.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return said


@pytest.fixture
def systemd(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    path = tmp / "notify.sock"
    listener = NotifySocket(path)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield listener
    listener.sock.close()


async def test_systemd_notify_ready_reloading_stopping(
    tmp: Path, upstream: Upstream, systemd: NotifySocket
) -> None:
    cfg = base_config(tmp, upstream.port)
    port = free_port()
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    proc = GuardProcess(write_config(tmp / "smtpguard.yaml", cfg), tmp / "guard.log")
    proc.start()
    try:
        ready = await systemd.next()
        assert ready["READY"] == "1" and "zone" in ready["STATUS"]
        assert proc.proc is not None and ready["MAINPID"] == str(proc.proc.pid)
        # READY comes once the listener accepts.
        assert (await send(port, message("n1"))).code == 250
        proc.proc.send_signal(signal.SIGHUP)
        assert (await systemd.next())["RELOADING"] == "1"
        assert (await systemd.next())["READY"] == "1"
        proc.proc.send_signal(signal.SIGTERM)
        assert (await systemd.next())["STOPPING"] == "1"
        assert await asyncio.to_thread(proc.proc.wait, 10) == 0
    finally:
        await proc.astop()


async def test_store_errors_are_counted_where_they_happen(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"})
    async with running_guard(cfg) as guard:
        assert guard.store is not None and guard.health is not None
        # The fault: the store goes away under a running instance (closed, not mocked).
        await guard.store.close()
        try:
            client = await RawClient.connect(guard.ports[0])
            await client.reply()
            await client.ehlo()
            refused = await client.login()
            await client.close()
        finally:
            await guard.store.open()
        _, body = await http_get(guard.health.port, "/metrics")
    assert (refused.code, refused.enhanced) == (451, "4.3.0"), refused
    assert sample(body, "smtpguard_store_errors_total", where="auth") == 1


async def test_a_refused_reload_still_tells_systemd_ready(
    tmp: Path, upstream: Upstream, systemd: NotifySocket
) -> None:
    cfg = base_config(tmp, upstream.port)
    port = free_port()
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    path = write_config(tmp / "smtpguard.yaml", cfg)
    proc = GuardProcess(path, tmp / "guard.log")
    proc.start()
    try:
        assert (await systemd.next())["READY"] == "1"
        assert proc.proc is not None
        # A file the reload cannot use (here nested far too deep): refused, and systemd is
        # told READY again, or `systemctl reload` would wait for it until its timeout.
        path.write_text(path.read_text() + "x-deep: " + "[" * 998 + "]" * 998 + "\n")
        proc.proc.send_signal(signal.SIGHUP)
        assert (await systemd.next())["RELOADING"] == "1"
        assert (await systemd.next())["READY"] == "1"
        assert (await send(port, message("n1"))).code == 250
    finally:
        await proc.astop()
    assert "Traceback" not in (tmp / "guard.log").read_text()


async def test_a_sighup_while_stopping_tells_systemd_nothing_more(
    tmp: Path, upstream: Upstream, systemd: NotifySocket
) -> None:
    held = asyncio.Event()
    upstream.handler.default = Behaviour(hold_after_dot=held)
    cfg = base_config(tmp, upstream.port)
    cfg["providers"][0]["timeouts"]["data"] = "60s"  # held for as long as the test needs
    port = free_port()
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    proc = GuardProcess(write_config(tmp / "smtpguard.yaml", cfg), tmp / "guard.log")
    proc.start()
    try:
        assert (await systemd.next())["READY"] == "1"
        # A submission in flight keeps the drain going while the SIGHUP arrives.
        pending = asyncio.create_task(send(port, message("n1")))
        await upstream.wait_received(1)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        assert (await systemd.next())["STOPPING"] == "1"
        proc.proc.send_signal(signal.SIGHUP)
        log = tmp / "guard.log"
        assert await eventually(
            lambda: "reload refused: stopping" in log.read_text(), timeout=15, interval=0.05
        )
        held.set()
        assert (await pending).code == 250
        assert await asyncio.to_thread(proc.proc.wait, 15) == 0
        # Everything the process said is in the socket by the time it has exited.
        said = systemd.rest()
    finally:
        held.set()
        await proc.astop()
    assert not [d for d in said if "READY=1" in d or "RELOADING=1" in d], said
    assert upstream.event_keys() == ["n1"]
