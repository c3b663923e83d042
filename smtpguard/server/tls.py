"""The listeners' certificate: one read of the files into a fresh context, and its expiry."""

from __future__ import annotations

import ssl
from pathlib import Path

from smtpguard.config import Config, ConfigError, TLSFiles
from smtpguard.metrics import Metrics


def tls_context(config: Config) -> ssl.SSLContext | None:
    if config.tls is None:
        return None
    return certificate_context(config.tls)


def certificate_context(files: TLSFiles) -> ssl.SSLContext:
    """A fresh server context holding exactly this certificate and key (one read of each)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_certificate(ctx, files)
    return ctx


def load_certificate(ctx: ssl.SSLContext, files: TLSFiles) -> None:
    try:
        ctx.load_cert_chain(str(files.cert), str(files.key))
    except (OSError, ssl.SSLError) as e:
        raise ConfigError([f"tls: cannot load certificate {files.cert} / key {files.key}: {e}"]) from None


def certificate_expiry(config: Config) -> float | None:
    """The served certificate's notAfter, for the expiry gauge; None without TLS."""
    return certificate_not_after(config.tls.cert) if config.tls is not None else None


def gauge_expiry(metrics: Metrics, config: Config) -> None:
    """smtpguard_tls_certificate_expiry_timestamp_seconds: the served certificate's notAfter."""
    if (not_after := certificate_expiry(config)) is not None:
        metrics.cert_expiry.set(not_after)


def certificate_not_after(path: Path) -> float | None:
    """The certificate's notAfter as a Unix time, for the expiry gauge; None if unreadable.
    (The standard library decodes a PEM file only through this test hook; without it the
    gauge is just absent.)"""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        not_after = decode(str(path)).get("notAfter")
        return float(ssl.cert_time_to_seconds(not_after)) if not_after else None
    except (OSError, ValueError, ssl.SSLError):
        return None
