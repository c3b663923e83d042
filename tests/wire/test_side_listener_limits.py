"""Each side listener's own limits (DESIGN.md §18), measured on real sockets: a connection
that sends nothing is closed after idle_timeout, one trickling its request headers, its body
or an SMTP command is closed read_timeout after its first byte, whatever it sends meanwhile;
a keep-alive client is served and then closed when idle; the caps per address and in total
refuse at accept and give the slot back when a connection closes. The settings are
validated like every other (path and line)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from smtpguard.admission import Admission
from smtpguard.config import ConfigError, loads
from smtpguard.policy.http_trust import limit_unit
from smtpguard.server import Server
from tests.support import Upstream, base_config, password_hash, running_guard
from tests.support import events as ev
from tests.support.eventually import eventually

READ = 0.6
IDLE = 1.2
LIMITS = {
    "max_connections": 5,
    "max_connections_per_ip": 3,
    "read_timeout": "600ms",
    "idle_timeout": "1200ms",
}
LISTENERS = ["events", "console", "mailbox"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> ev.Keys:
    return ev.Keys.make(tmp_path_factory.mktemp("keys"))


@pytest.fixture
async def guard(
    tmp: Path, upstream: Upstream, keys: ev.Keys, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Server]:
    for name, value in keys.env().items():
        monkeypatch.setenv(name, value)
    cfg = base_config(
        tmp,
        upstream.port,
        events={
            "address": "127.0.0.1:0",
            "sources": keys.sources(),
            **LIMITS,
            "mailbox": {
                "listen": "127.0.0.1:0",
                "address": "reports@guard.test",
                "provider": "primary",
                **LIMITS,
            },
        },
        console={
            "address": "127.0.0.1:0",
            "operators": [{"username": "alice", "password_hash": password_hash("pw-alice-1")}],
            **LIMITS,
        },
    )
    async with running_guard(cfg) as server:
        yield server


def port_of(guard: Server, listener: str) -> int:
    part = {"events": guard.events, "console": guard.console, "mailbox": guard.mailbox}[listener]
    assert part is not None
    return part.port


def admission_of(guard: Server, listener: str) -> Admission:
    """The listener's count of the connections it holds (what its limits are measured on)."""
    if listener == "mailbox":
        assert guard.mailbox is not None
        return guard.mailbox.admission
    if listener == "events":
        assert guard.events is not None
        return guard.events.listener.admission
    assert guard.console is not None
    return guard.console._listener.admission


async def released_to(guard: Server, listener: str, total: int) -> None:
    """Until the listener holds `total` connections (it has seen the others close)."""
    admission = admission_of(guard, listener)
    held = await eventually(lambda: admission.total, lambda n: n <= total, timeout=5, interval=0.02)
    assert held <= total, f"{listener} still holds {held} connections"


async def connect(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_after(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, trickle: bytes = b""
) -> tuple[float, bytes, int]:
    """Seconds until the listener closes the connection (a close that does not come within
    5 s fails the test), what it sent, and how many bytes of `trickle` (one every 0.1 s) had
    gone out by then."""
    started = time.monotonic()
    got = bytearray()
    dribbled = 0

    async def dribble() -> None:
        nonlocal dribbled
        for byte in trickle:
            if writer.is_closing() or reader.at_eof():
                return
            with contextlib.suppress(OSError):
                writer.write(bytes([byte]))
                dribbled += 1
            await asyncio.sleep(0.1)

    task = asyncio.create_task(dribble())
    try:
        async with asyncio.timeout(5):
            while chunk := await reader.read(4096):
                got += chunk
    except ConnectionError:
        pass
    finally:
        task.cancel()
        writer.close()
    return time.monotonic() - started, bytes(got), dribbled


HEADERS = {
    "events": b"POST /events/ses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n",
    "console": b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n",
}


@pytest.mark.parametrize("listener", LISTENERS)
async def test_an_idle_connection_is_closed_after_idle_timeout(guard: Server, listener: str) -> None:
    took, _, _ = await closed_after(*await connect(port_of(guard, listener)))
    # Not before idle_timeout; and closed at all (closed_after's bound), not left open.
    assert took >= IDLE - 0.1, took


@pytest.mark.parametrize("listener", LISTENERS)
async def test_a_trickled_request_is_cut_read_timeout_after_its_first_byte(
    guard: Server, listener: str
) -> None:
    # 40 bytes at 10 a second would take 4 s: the listener stops it at read_timeout.
    first = (
        b"EHLO slow.example\r\nMAIL FROM:<a@slow.example>"
        if listener == "mailbox"
        else HEADERS[listener][:40]
    )
    reader, writer = await connect(port_of(guard, listener))
    if listener == "mailbox":
        assert (await reader.readline()).startswith(b"220")
    took, got, dribbled = await closed_after(reader, writer, first)
    # Not before read_timeout, and cut while the request was still trickling in.
    assert took >= READ - 0.1, took
    assert dribbled < len(first), dribbled
    assert (b"421 4.4.2" if listener == "mailbox" else b"HTTP/1.1 408") in got, got


@pytest.mark.parametrize("listener", ["events", "console"])
async def test_a_trickled_body_is_cut_read_timeout_after_its_first_byte(
    guard: Server, listener: str, caplog: pytest.LogCaptureFixture, no_tracebacks: None
) -> None:
    reader, writer = await connect(port_of(guard, listener))
    writer.write(HEADERS[listener])
    took, _, dribbled = await closed_after(reader, writer, b"x" * 40)
    # Not before read_timeout, and cut while the body was still trickling in.
    assert took >= READ - 0.1, took
    assert dribbled < 40, dribbled
    if listener == "events":
        # The handler reading the body learns it will not come whole: one line, nothing applied.
        await eventually(
            lambda: caplog.messages, lambda m: "provider event body aborted" in m, timeout=2, interval=0.1
        )
        assert caplog.messages.count("provider event body aborted") == 1


@pytest.mark.parametrize("listener", ["events", "console"])
async def test_a_keep_alive_client_is_served_then_closed_when_idle(guard: Server, listener: str) -> None:
    reader, writer = await connect(port_of(guard, listener))
    path = b"/login" if listener == "console" else b"/events/nosuch"
    for _ in range(2):
        writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status = await asyncio.wait_for(reader.readline(), 2)
        assert status.split()[1] in (b"200", b"405"), status
        length = 0
        while (line := await asyncio.wait_for(reader.readline(), 2)) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
    # Closed once idle (closed_after fails the test when no close comes).
    await closed_after(reader, writer)


async def _refused(reader: asyncio.StreamReader) -> bool:
    try:
        data = await asyncio.wait_for(reader.read(200), 0.5)
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return data.startswith((b"HTTP/1.1 503", b"421 4.7.0"))


@pytest.mark.parametrize("listener", LISTENERS)
async def test_the_caps_refuse_at_accept_and_give_slots_back(
    guard: Server, listener: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    port = port_of(guard, listener)
    a = [await connect(port, "127.0.0.10") for _ in range(4)]
    # The fourth from one address is over max_connections_per_ip (3).
    assert [await _refused(r) for r, _ in a[3:]] == [True]
    b = [await connect(port, "127.0.0.11") for _ in range(3)]
    # Two more fit (5 in total), the third is over max_connections.
    if listener == "mailbox":
        # The mailbox greets the admitted ones and refuses with 421.
        lines = [await asyncio.wait_for(r.readline(), 1) for r, _ in b]
        assert [line[:3] for line in lines] == [b"220", b"220", b"421"]
    else:
        assert [await _refused(r) for r, _ in b] == [False, False, True]
    # One of the first address closes: its slot is free again, for anyone.
    a[0][1].close()
    await released_to(guard, listener, 4)
    r, w = await connect(port, "127.0.0.12")
    if listener == "mailbox":
        assert (await asyncio.wait_for(r.readline(), 1)).startswith(b"220")
    else:
        assert not await _refused(r)
    for _, writer in [*a, *b, (r, w)]:
        writer.close()
    # Two refusals, one warning: a listener under attack does not flood the log.
    warnings = [
        m for m in caplog.messages if m == "connection refused: the listener is at its connection cap"
    ]
    assert len(warnings) == 1


def test_an_ipv6_client_is_counted_by_its_64() -> None:
    assert limit_unit("2001:db8:1:2::1") == limit_unit("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert limit_unit("2001:db8:1:3::1") != limit_unit("2001:db8:1:2::1")
    assert limit_unit("::ffff:192.0.2.7") == "192.0.2.7"
    assert limit_unit("192.0.2.7") == "192.0.2.7"


DEFAULTS = (256, 32, 10.0, 15.0)


def _values(limits: Any) -> tuple[int, int, float, float]:
    return (limits.max_connections, limits.max_connections_per_ip, limits.read_timeout, limits.idle_timeout)


def _cfg(tmp: Path, section: str, **limits: Any) -> dict[str, Any]:
    mailbox = {"listen": "127.0.0.1:0", "address": "r@guard.test", "provider": "primary"}
    if section == "events.mailbox":
        return base_config(tmp, 2525, events={"mailbox": {**mailbox, **limits}})
    if section == "console":
        return base_config(tmp, 2525, console={"address": "127.0.0.1:0", **limits})
    return base_config(tmp, 2525, events={"address": "127.0.0.1:0", **limits})


@pytest.mark.parametrize("section", ["events", "console", "events.mailbox"])
def test_the_limits_have_defaults_and_bad_values_name_their_line(tmp: Path, section: str) -> None:
    import yaml

    cfg = loads(yaml.safe_dump(_cfg(tmp, section)))
    part: Any = {"events": cfg.events, "console": cfg.console}.get(section) or (
        cfg.events and cfg.events.mailbox
    )
    assert _values(part) == DEFAULTS
    for key, bad in [("max_connections", 0), ("max_connections_per_ip", "many"), ("read_timeout", "soon")]:
        text = yaml.safe_dump(_cfg(tmp, section, **{key: bad}), sort_keys=False)
        with pytest.raises(ConfigError) as e:
            loads(text)
        line = next(i for i, t in enumerate(text.splitlines(), 1) if t.strip().startswith(f"{key}:"))
        assert any(f": {section}.{key} (line {line})" in p for p in e.value.problems), e.value.problems


def test_each_listener_is_held_to_its_config_section_and_the_events_server_to_the_defaults(
    guard: Server,
) -> None:
    from smtpguard.events.sources import Sources
    from smtpguard.events.web import EventsServer

    cfg = guard.config
    assert cfg.events is not None and guard.events is not None and guard.mailbox is not None
    assert guard.console is not None and guard.console._listener is not None
    held = [guard.events.listener, guard.console._listener, guard.mailbox]
    assert [h.admission.limits for h in held] == [cfg.events, cfg.console, cfg.events.mailbox]
    assert {_values(h.admission.limits) for h in held} == {(5, 3, READ, IDLE)}
    server = EventsServer(Sources(), None, 1_000_000, time.time, lambda *seen: None)  # type: ignore[arg-type]
    assert _values(server.listener.limits) == DEFAULTS


MALFORMED = {
    "header line over 8190 bytes": b"POST /login HTTP/1.1\r\nHost: a\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    "Content-Length with Transfer-Encoding": (
        b"POST /login HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "bare LF line ends": b"POST /login HTTP/1.1\nHost: a\nContent-Length: 0\n\n",
    "200 header fields": b"GET /login HTTP/1.1\r\n"
    + b"".join(b"X%d: y\r\n" % i for i in range(200))
    + b"\r\n",
}


@pytest.mark.parametrize("listener", ["events", "console"])
async def test_malformed_http_is_400_and_one_log_line_without_a_traceback(
    guard: Server, listener: str, caplog: pytest.LogCaptureFixture, no_tracebacks: None
) -> None:
    for request in MALFORMED.values():
        reader, writer = await connect(port_of(guard, listener))
        writer.write(request)
        _, got, _ = await closed_after(reader, writer)
        assert got.startswith(b"HTTP/1.0 400") or got.startswith(b"HTTP/1.1 400"), got[:80]
    lines = [r for r in caplog.records if r.getMessage() == "malformed HTTP request refused"]
    assert len(lines) == len(MALFORMED)
    assert {getattr(r, "listener", None) for r in lines} == {listener}
