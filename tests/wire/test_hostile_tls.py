"""STARTTLS: the happy path, AUTH before TLS, command injection (CVE-2011-0411 class), and
the config rule that keeps AUTH off clear-text network listeners."""

from __future__ import annotations

import base64
from pathlib import Path

import aiosmtplib
import pytest
import yaml

from smtpguard.config import ConfigError, loads
from tests.support import PASSWORD, Upstream, base_config, running_guard
from tests.support.hostile import (
    RawClient,
    all_released,
    client_tls,
    message_bytes,
    terminated,
    with_starttls,
)

# Every hostile case must leave no traceback in the logs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_tracebacks")


AUTH_PLAIN = "AUTH PLAIN " + base64.b64encode(f"\0acme-app\0{PASSWORD}".encode()).decode()


async def test_starttls_then_auth_then_send(tmp: Path, upstream: Upstream) -> None:
    cfg = with_starttls(base_config(tmp, upstream.port), tmp)
    async with running_guard(cfg) as guard:
        client = aiosmtplib.SMTP(
            hostname="localhost",
            port=guard.ports[0],
            start_tls=True,
            tls_context=client_tls(Path(cfg["tls"]["cert"])),
            timeout=10,
        )
        await client.connect()
        try:
            assert client.get_transport_info("sslcontext") is not None
            await client.login("acme-app", PASSWORD)
            errors, text = await client.sendmail(
                "billing@acme.example", ["customer@example.com"], message_bytes("tls:1")
            )
        finally:
            await client.quit()
    assert errors == {} and "[sg:" in text
    assert len(upstream.received) == 1


async def test_auth_before_starttls_is_538(tmp: Path, upstream: Upstream) -> None:
    cfg = with_starttls(base_config(tmp, upstream.port), tmp)
    async with running_guard(cfg) as guard:
        c = await RawClient.connect(guard.ports[0])
        try:
            await c.reply()
            ehlo = await c.ehlo()
            assert "STARTTLS" in ehlo.text and "AUTH" not in ehlo.text
            auth = await c.command(AUTH_PLAIN)
            assert (auth.code, auth.enhanced) == (538, "5.7.11"), auth
            login = await c.command("AUTH LOGIN")
            assert login.code == 538, login
            mail = await c.command("MAIL FROM:<billing@acme.example>")
            assert (mail.code, mail.enhanced) == (530, "5.7.0"), mail
        finally:
            await c.close()
    assert upstream.handler.transactions == 0


async def test_commands_pipelined_after_starttls_are_discarded(tmp: Path, upstream: Upstream) -> None:
    cfg = with_starttls(base_config(tmp, upstream.port), tmp)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        c = await RawClient.connect(port)
        try:
            await c.reply()
            await c.ehlo()
            # One packet: STARTTLS and, in clear, a whole transaction a man in the middle added.
            c.write(
                b"STARTTLS\r\n"
                + AUTH_PLAIN.encode()
                + b"\r\nMAIL FROM:<billing@acme.example>\r\nRCPT TO:<victim@example.org>\r\nDATA\r\n"
                + terminated(message_bytes("injected:1", to="victim@example.org"))
            )
            ready = await c.reply()
            assert ready.code == 220, ready
            await c.starttls(client_tls(Path(cfg["tls"]["cert"])))
            # Nothing of the injected text was executed: the first reply is NOOP's own, the
            # session starts over (EHLO needed) and is not authenticated.
            assert (await c.command("NOOP")).code == 250
            assert (await c.command("MAIL FROM:<billing@acme.example>")).code == 503
            ehlo = await c.ehlo()
            assert "AUTH" in ehlo.text and "STARTTLS" not in ehlo.text
            mail = await c.command("MAIL FROM:<billing@acme.example>")
            assert (mail.code, mail.enhanced) == (530, "5.7.0"), mail
        finally:
            await c.close()
    assert upstream.handler.transactions == 0


async def test_clear_text_instead_of_a_tls_handshake_is_dropped_and_others_are_served(
    tmp: Path, upstream: Upstream
) -> None:
    cfg = with_starttls(base_config(tmp, upstream.port), tmp)
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        c = await RawClient.connect(port)
        try:
            await c.reply()
            await c.ehlo()
            assert (await c.command("STARTTLS")).code == 220
            c.write(AUTH_PLAIN.encode() + b"\r\nMAIL FROM:<billing@acme.example>\r\n" + b"x" * 4096)
            assert await c.closed()
        finally:
            await c.close()
        # The listener still serves a well-behaved TLS client.
        client = aiosmtplib.SMTP(
            hostname="localhost", port=port, start_tls=True, tls_context=client_tls(Path(cfg["tls"]["cert"]))
        )
        await client.connect()
        await client.login("acme-app", PASSWORD)
        await client.sendmail("billing@acme.example", ["customer@example.com"], message_bytes("tls:2"))
        await client.quit()
        assert await all_released(guard)
    assert len(upstream.received) == 1


@pytest.mark.parametrize("address", ["0.0.0.0:2587", "192.0.2.10:587", "[::]:587", "mail.example.com:587"])
def test_tls_none_off_loopback_is_a_config_error(tmp: Path, address: str) -> None:
    cfg = base_config(tmp, 2525)
    cfg["listen"] = [{"address": address, "tls": "none"}]
    with pytest.raises(ConfigError) as e:
        loads(yaml.safe_dump(cfg))
    assert "listen[0]" in str(e.value) and "loopback" in str(e.value)


@pytest.mark.parametrize("address", ["127.0.0.1:2587", "[::1]:2587", "localhost:2587"])
def test_tls_none_on_loopback_is_allowed(tmp: Path, address: str) -> None:
    cfg = base_config(tmp, 2525)
    cfg["listen"] = [{"address": address, "tls": "none"}]
    assert loads(yaml.safe_dump(cfg)).listen[0].tls == "none"


async def test_auth_in_clear_is_refused_on_a_network_listener(tmp: Path, upstream: Upstream) -> None:
    """A listener reachable off the host can only be starttls or implicit; on starttls, the
    credentials never cross the network before the upgrade (538), whatever the mechanism."""
    cfg = with_starttls(base_config(tmp, upstream.port), tmp)
    async with running_guard(cfg) as guard:
        c = await RawClient.connect(guard.ports[0])
        try:
            await c.reply()
            await c.ehlo()
            for line in (AUTH_PLAIN, "AUTH LOGIN " + base64.b64encode(b"acme-app").decode(), "AUTH PLAIN"):
                reply = await c.command(line)
                assert reply.code == 538, (line, reply)
        finally:
            await c.close()
    assert upstream.handler.transactions == 0
