"""Operations: /metrics, /healthz, /readyz, SIGHUP reload, SIGTERM drain, check-config."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import yaml

from smtpguard.cli import main
from tests.support import (
    OTHER_PASSWORD,
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


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def sample(body: str, name: str, **labels: str) -> float:
    """The value of one exposed sample, matching its labels in any order."""
    for line in body.splitlines():
        metric, _, rest = line.partition("{")
        if metric != name or "}" not in rest:
            continue
        raw, _, value = rest.rpartition("} ")
        got = dict(pair.split("=", 1) for pair in raw.split(",") if pair)
        if {k: v.strip('"') for k, v in got.items()} == labels:
            return float(value)
    raise AssertionError(f"{name}{labels} not exposed")


async def test_metrics_count_submissions_and_upstream_replies(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"})
    upstream.handler.script = [Behaviour(), Behaviour(data="451 4.3.0 later")]
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        await send(port, message("m1"))
        await send(port, message("m1"))
        await send(port, message("m2"))
        await send(port, message("m3", sender="someone@evil.example"), sender="someone@evil.example")
        assert guard.health is not None
        status, body = await http_get(guard.health.port, "/metrics")
        assert status == 200
        assert sample(body, "smtpguard_submissions_total", zone="acme", decision="relayed") == 1
        assert sample(body, "smtpguard_submissions_total", zone="acme", decision="duplicate") == 1
        assert sample(body, "smtpguard_submissions_total", zone="acme", decision="deferred") == 1
        assert sample(body, "smtpguard_submissions_total", zone="acme", decision="rejected:envelope") == 1
        assert sample(body, "smtpguard_upstream_replies_total", provider="primary", **{"class": "2xx"}) == 1
        assert sample(body, "smtpguard_upstream_replies_total", provider="primary", **{"class": "4xx"}) == 1
        assert sample(body, "smtpguard_upstream_latency_seconds_count", provider="primary") == 2
        assert sample(body, "smtpguard_breaker_state", provider="primary") == 0
        assert (await http_get(guard.health.port, "/healthz"))[0] == 200
        ready, why = await http_get(guard.health.port, "/readyz")
        assert ready == 200, why
        assert (await http_get(guard.health.port, "/nope"))[0] == 404


async def test_readyz_fails_when_every_circuit_is_open(tmp: Path) -> None:
    dead = free_port()
    cfg = base_config(
        tmp, dead, metrics={"address": "127.0.0.1:0"}, breaker={"failure_threshold": 1, "cooldown": "1h"}
    )
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("r1"))
        assert reply.code == 451 and reply.text.startswith("4.4.1")
        assert guard.health is not None
        status, body = await http_get(guard.health.port, "/readyz")
        assert status == 503 and "circuit" in body
        _, metrics = await http_get(guard.health.port, "/metrics")
        assert sample(metrics, "smtpguard_breaker_state", provider="primary") == 2
        assert guard.store is not None
        circuits = await eventually(  # published to the store off the hot path
            guard.store.circuits, lambda c: bool(c) and c[0].circuit == "open", timeout=1, interval=0.02
        )
        assert [(c.provider, c.circuit) for c in circuits] == [("primary", "open")]


async def test_sighup_reloads_users_and_refuses_a_bad_file(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port)
    cfg["listen"] = [{"address": f"127.0.0.1:{free_port()}", "tls": "none"}]
    port = int(cfg["listen"][0]["address"].rsplit(":", 1)[1])
    globex = cfg["zones"].pop("globex")
    path = write_config(tmp / "smtpguard.yaml", cfg)
    proc = GuardProcess(path, tmp / "guard.log")
    proc.start()
    try:
        await proc.wait_port(port)
        before = await send(
            port,
            message("g1", sender="news@globex.example"),
            user="globex-app",
            password=OTHER_PASSWORD,
            sender="news@globex.example",
        )
        assert before.code == 535
        cfg["zones"]["globex"] = globex
        write_config(path, cfg)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGHUP)
        after = await eventually(
            lambda: send(
                port,
                message("g1", sender="news@globex.example"),
                user="globex-app",
                password=OTHER_PASSWORD,
                sender="news@globex.example",
            ),
            lambda r: r.code == 250,
            timeout=5,
            interval=0.1,
        )
        assert after.code == 250
        # A broken file is refused; the running config (with globex) stays.
        path.write_text("zones: [this is not valid\n")
        proc.proc.send_signal(signal.SIGHUP)
        # Only once serve has read it and said so can "still served" show anything.
        log = proc.log_path
        logged = await eventually(
            lambda: log.read_text(errors="replace"),
            lambda text: "reload refused; keeping the running config" in text,
            timeout=10,
            interval=0.05,
        )
        assert "reload refused; keeping the running config" in logged, logged[-2000:]
        still = await send(
            port,
            message("g2", sender="news@globex.example"),
            user="globex-app",
            password=OTHER_PASSWORD,
            sender="news@globex.example",
        )
        assert still.code == 250
    finally:
        assert await proc.astop() == 0
    log = (tmp / "guard.log").read_text()
    assert "reload refused" in log and "config reloaded" in log
    assert upstream.event_keys() == ["g1", "g2"]


async def test_sigterm_lets_in_flight_submission_finish(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=1.0)
    cfg = base_config(tmp, upstream.port)
    port = free_port()
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    proc = GuardProcess(write_config(tmp / "g.yaml", cfg), tmp / "guard.log")
    proc.start()
    try:
        await proc.wait_port(port)
        pending = asyncio.create_task(send(port, message("t1")))
        await upstream.wait_received(1)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        reply = await pending
        assert reply.code == 250
        rc = await asyncio.to_thread(proc.proc.wait, 10)
        assert rc == 0
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        await proc.astop()
    assert len(upstream.received) == 1


def test_check_config_names_path_and_line(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = base_config(tmp, 2525)
    cfg["zones"]["acme"]["hourly_cpa"] = 5
    cfg["zones"]["acme"]["users"][0]["password_hash"] = "plaintext"
    cfg["event_key"]["retention"] = "2d"
    path = write_config(tmp / "bad.yaml", cfg)
    assert main(["check-config", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    text = path.read_text().splitlines()
    line_of: dict[str, int] = {}
    for i, line in enumerate(text):
        for key in ("hourly_cpa", "password_hash", "retention"):
            if key in line:
                line_of.setdefault(key, i + 1)
    assert f"zones.acme.hourly_cpa (line {line_of['hourly_cpa']}): unknown key" in err
    assert f"zones.acme.users[0].password_hash (line {line_of['password_hash']})" in err
    assert f"event_key.retention (line {line_of['retention']})" in err and "5d" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("mutate", "expect"),
    [
        (lambda c: c["listen"][0].update(address="0.0.0.0:2587"), "loopback"),
        (lambda c: c["listen"][0].update(tls="starttls"), "tls: {cert, key}"),
        (
            lambda c: (
                c["limits"].update(max_message_size="25 parsecs")
                if "limits" in c
                else c.update(limits={"max_message_size": "25 parsecs"})
            ),
            "not a size",
        ),
        (lambda c: c["providers"][0].update(username="u"), "password_env or password_file"),
        (
            lambda c: c["providers"][0].update(password_env="NOT_SET_ANYWHERE", username="u"),
            "NOT_SET_ANYWHERE is not set",
        ),
        (lambda c: c.pop("providers"), "providers (line 1): required key is missing"),
        (lambda c: c["zones"]["acme"].update(plan="gold"), "zones.acme.plan"),
    ],
)
def test_check_config_errors(
    tmp: Path, capsys: pytest.CaptureFixture[str], mutate: object, expect: str
) -> None:
    cfg = base_config(tmp, 2525)
    mutate(cfg)  # type: ignore[operator]
    path = write_config(tmp / "c.yaml", cfg)
    assert main(["check-config", "-c", str(path)]) == 1
    assert expect in capsys.readouterr().err


def test_check_config_unreadable_and_invalid_yaml(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "-c", str(tmp / "missing.yaml")]) == 1
    assert "no such file" in capsys.readouterr().err
    bad = tmp / "bad.yaml"
    bad.write_text("listen:\n  - address: [\n")
    assert main(["check-config", "-c", str(bad)]) == 1
    assert "invalid YAML" in capsys.readouterr().err


def test_check_config_accepts_the_shipped_default(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    assert main(["check-config", "-c", str(root / "conf" / "smtpguard.yaml")]) == 0
    assert "config OK" in capsys.readouterr().out


async def test_history_json_shape(tmp: Path, upstream: Upstream, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = base_config(tmp, upstream.port)
    path = write_config(tmp / "c.yaml", cfg)
    async with running_guard(cfg) as guard:
        await send(guard.ports[0], message("h1"))
    assert await asyncio.to_thread(main, ["history", "acme", "h1", "--json", "-c", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"zone", "key", "state", "fingerprint", "created_at", "updated_at", "attempts", "audit"} <= set(
        doc
    )
    assert doc["state"] == "delivered" and len(doc["attempts"]) == 1
    attempt = doc["attempts"][0]
    assert {
        "at",
        "instance",
        "provider",
        "phase",
        "code",
        "enhanced",
        "text",
        "upstream_id",
        "message_id",
    } <= set(attempt)
    assert attempt["code"] == 250 and attempt["provider"] == "primary"
    assert attempt["phase"] == "data_sent" and attempt["upstream_id"] == "Q1"
    assert await asyncio.to_thread(main, ["history", "acme", "nope", "-c", str(path)]) == 3
    assert "no record" in capsys.readouterr().err


def test_hash_password_reads_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from argon2 import PasswordHasher

    monkeypatch.setattr("sys.stdin", io.StringIO("hunter2\n"))
    assert main(["hash-password"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("$argon2id$") and PasswordHasher().verify(out, "hunter2")


def test_yaml_helper_roundtrip(tmp: Path) -> None:
    # The shipped default config must stay loadable YAML with a demo user.
    root = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "conf" / "smtpguard.yaml").read_text())
    assert doc["zones"]["demo"]["users"][0]["username"] == "demo-app"


async def test_sink_command_writes_a_maildir(tmp: Path) -> None:
    import sys

    port = free_port()
    maildir = tmp / "sink"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "smtpguard",
        "sink",
        "--listen",
        f"127.0.0.1:{port}",
        "--maildir",
        str(maildir),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        banner = await asyncio.wait_for(proc.stdout.readline(), 15)
        assert b"listening" in banner
        reply = await send(port, message("sink1"), user="")
        assert reply.code == 250 and "queued as" in reply.text
        files = list((maildir / "new").iterdir())
        assert len(files) == 1 and b"X-Event-Key: sink1" in files[0].read_bytes()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_a_reload_of_deeply_nested_yaml_is_refused_and_counted(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, metrics={"address": "127.0.0.1:0"})
    path = tmp / "smtpguard.yaml"
    async with running_guard(cfg, config_path=path) as guard:
        path.write_text(path.read_text() + "x-deep: " + "[" * 998 + "]" * 998 + "\n")
        assert not await guard.reload()
        assert (await send(guard.ports[0], message("deep1"))).code == 250
        assert guard.health is not None
        _, body = await http_get(guard.health.port, "/metrics")
    assert sample(body, "smtpguard_config_reloads_total", result="refused") == 1
