"""A SIGHUP re-reads the TLS pair into a fresh context: the next handshake on every listener
(STARTTLS and implicit) gets the new certificate, a bad or half-written pair leaves the old
one serving, and a key-type change (RSA → ECDSA) leaves no old certificate behind."""

from __future__ import annotations

import asyncio
import datetime
import shutil
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from smtpguard.server import Server
from tests.support import Upstream, base_config, running_guard
from tests.support.hostile import make_cert

pytestmark = pytest.mark.usefixtures("no_tracebacks")


def make_rsa_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed RSA certificate for localhost (make_cert's are ECDSA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(exist_ok=True)
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def der_of(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


def any_cert() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def rsa_only() -> ssl.SSLContext:
    """A client that accepts nothing but an RSA certificate (TLS 1.2, RSA-signed suites)."""
    ctx = any_cert()
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers("aRSA")
    return ctx


def served(port: int, starttls: bool, ctx: ssl.SSLContext | None = None) -> bytes:
    """The certificate one new handshake gets (a real client socket, no SNI: 127.0.0.1)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        if starttls:
            f = raw.makefile("rb")
            f.readline()
            raw.sendall(b"EHLO client.test\r\n")
            while f.readline()[3:4] == b"-":
                pass
            raw.sendall(b"STARTTLS\r\n")
            assert f.readline().startswith(b"220")
        with (ctx or any_cert()).wrap_socket(raw) as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            return der


async def on_both(guard: Server, ctx: ssl.SSLContext | None = None) -> list[bytes]:
    starttls, implicit = guard.ports
    return [
        await asyncio.to_thread(served, starttls, True, ctx),
        await asyncio.to_thread(served, implicit, False, ctx),
    ]


def tls_config(tmp: Path, upstream: Upstream, cert: Path, key: Path) -> dict[str, Any]:
    cfg = base_config(tmp, upstream.port)
    cfg["tls"] = {"cert": str(cert), "key": str(key)}
    cfg["listen"] = [
        {"address": "127.0.0.1:0", "tls": "starttls"},
        {"address": "127.0.0.1:0", "tls": "implicit"},
    ]
    return cfg


async def test_a_renewed_pair_is_served_to_the_next_handshake_and_a_bad_one_keeps_the_old(
    tmp: Path, upstream: Upstream
) -> None:
    cert, key = make_cert(tmp)
    cfg = tls_config(tmp, upstream, cert, key)
    renewed = tmp / "renewed"
    renewed.mkdir()
    new_cert, new_key = make_cert(renewed)
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        old = der_of(cert)
        assert await on_both(guard) == [old, old]
        # A broken key: refused, the old pair serves on both listeners.
        saved = key.read_bytes()
        key.write_text("not a key\n")
        assert not await guard.reload()
        assert await on_both(guard) == [old, old]
        # A cert that does not match the key: refused too.
        key.write_bytes(saved)
        shutil.copy(new_cert, cert)
        assert not await guard.reload()
        assert await on_both(guard) == [old, old]
        # The whole renewed pair: the next handshake on each listener gets it.
        shutil.copy(new_key, key)
        assert await guard.reload()
        assert await on_both(guard) == [der_of(new_cert)] * 2


async def test_a_reload_from_rsa_to_ecdsa_leaves_no_rsa_certificate(tmp: Path, upstream: Upstream) -> None:
    cert, key = make_rsa_cert(tmp / "rsa")
    cfg = tls_config(tmp, upstream, cert, key)
    ec_cert, ec_key = make_cert(tmp)
    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        assert await on_both(guard, rsa_only()) == [der_of(cert)] * 2
        cfg["tls"] = {"cert": str(ec_cert), "key": str(ec_key)}
        path = tmp / "smtpguard.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        assert await guard.reload()
        assert await on_both(guard) == [der_of(ec_cert)] * 2
        for port, starttls in zip(guard.ports, (True, False), strict=True):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await asyncio.to_thread(served, port, starttls, rsa_only())


async def test_reloads_racing_a_renewal_never_leave_a_broken_context(tmp: Path, upstream: Upstream) -> None:
    """A renewal hook rewriting cert then key, over and over, while reloads run: each reload
    is applied or refused (never raises), and every handshake after it completes with one
    of the two whole pairs."""
    cert, key = make_cert(tmp)
    cfg = tls_config(tmp, upstream, cert, key)
    renewed = tmp / "renewed"
    renewed.mkdir()
    new_cert, new_key = make_cert(renewed)
    pairs = [(cert.read_bytes(), key.read_bytes()), (new_cert.read_bytes(), new_key.read_bytes())]
    served_ok = {der_of(tmp / "cert.pem"), der_of(renewed / "cert.pem")}
    stop = threading.Event()

    def renew() -> None:
        i = 0
        while not stop.is_set():
            c, k = pairs[i % 2]
            cert.write_bytes(c)
            key.write_bytes(k)
            i += 1

    async with running_guard(cfg, config_path=tmp / "smtpguard.yaml") as guard:
        writer = threading.Thread(target=renew, daemon=True)
        writer.start()
        try:
            outcomes = []
            for _ in range(100):
                outcomes.append(await guard.reload())
                assert await asyncio.to_thread(served, guard.ports[1], False) in served_ok
        finally:
            stop.set()
            writer.join(5)
        assert any(outcomes)
