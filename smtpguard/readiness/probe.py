"""One provider probe: connect, EHLO, STARTTLS (certificate checked), AUTH, QUIT.

Never MAIL: a probe must not be able to send anything, so it stops before the one command
that opens a transaction. Used by `smtpguard doctor` and, every `probe_interval`, by
`serve` (the `smtpguard_provider_ready` gauge and the share routing read its result).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
from pathlib import Path

import aiosmtplib

from smtpguard.config import MaildirProviderConfig, SmtpProviderConfig
from smtpguard.policy.readiness import ProbeResult

_X509_V_ERR_CERT_HAS_EXPIRED = 10


def tls_context(cfg: SmtpProviderConfig) -> ssl.SSLContext:
    """As the relay verifies: the provider's `ca_file`, else the system store
    (`SSL_CERT_FILE` honoured by OpenSSL's default paths)."""
    ctx = ssl.create_default_context(cafile=str(cfg.ca_file) if cfg.ca_file else None)
    if not cfg.verify_tls:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def probe_smtp(cfg: SmtpProviderConfig, password: str | None, helo: str) -> ProbeResult:
    t = cfg.timeouts
    ctx = tls_context(cfg) if cfg.tls != "none" else None
    conn = aiosmtplib.SMTP(
        hostname=cfg.host,
        port=cfg.port,
        use_tls=cfg.tls == "implicit",
        start_tls=False,
        tls_context=ctx,
        local_hostname=cfg.helo_name or helo,
        timeout=t.command,
    )
    step = "connect"
    try:
        await conn.connect(timeout=t.connect)
        step = "EHLO"
        await conn.ehlo(timeout=t.command)
        if cfg.tls == "starttls":
            step = "STARTTLS"
            await conn.starttls(tls_context=ctx, timeout=t.command)
            step = "EHLO after STARTTLS"
            await conn.ehlo(timeout=t.command)
        not_after = _not_after(conn)
        done = f"connect, EHLO{', STARTTLS' if cfg.tls == 'starttls' else ''}"
        if cfg.username:
            step = "AUTH"
            await conn.login(cfg.username, password or "", timeout=t.command)
            done += ", AUTH"
        step = "QUIT"
        with contextlib.suppress(aiosmtplib.SMTPException, OSError):
            await conn.quit(timeout=t.command)
        return ProbeResult(True, f"{done}, QUIT ok", cert_not_after=not_after)
    except aiosmtplib.SMTPResponseException as e:
        return ProbeResult(False, f"{step}: {e.code} {' '.join(e.message.split())}"[:300])
    except Exception as e:
        verify = _verify_error(e)
        if verify is not None:
            expired = verify.verify_code == _X509_V_ERR_CERT_HAS_EXPIRED
            what = "certificate expired" if expired else "certificate not trusted"
            return ProbeResult(False, f"{step}: {what} ({verify.verify_message})", cert_expired=expired)
        return ProbeResult(False, f"{step}: {_describe(e)}")
    finally:
        conn.close()


def probe_maildir(cfg: MaildirProviderConfig) -> ProbeResult:
    """A Maildir provider is ready when its directory is (or can be made) writable."""
    path: Path = cfg.path
    while not path.exists() and path != path.parent:
        path = path.parent
    if os.access(path, os.W_OK | os.X_OK):
        return ProbeResult(True, f"maildir {cfg.path} writable")
    return ProbeResult(False, f"maildir {cfg.path}: {path} is not writable")


async def probe(
    cfg: SmtpProviderConfig | MaildirProviderConfig, password: str | None, helo: str
) -> ProbeResult:
    if isinstance(cfg, SmtpProviderConfig):
        return await probe_smtp(cfg, password, helo)
    return await asyncio.to_thread(probe_maildir, cfg)


def _not_after(conn: aiosmtplib.SMTP) -> float | None:
    cert = conn.get_transport_info("peercert")
    # Empty without verification (verify_tls: false): the expiry is then not known.
    if isinstance(cert, dict) and cert.get("notAfter"):
        return float(ssl.cert_time_to_seconds(str(cert["notAfter"])))
    return None


def _verify_error(e: BaseException) -> ssl.SSLCertVerificationError | None:
    seen: BaseException | None = e
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:300]
