"""Each source kind of §13: verify a request, then read its events into ProviderEvents.

No I/O here (the configured secrets are read by `build_sources`, once, at start). A request
gets exactly one verdict: `Verified` (its events, maybe none), or `Rejected` with the HTTP
status of §13 — 401 signature or auth missing, wrong or stale; 403 another SNS topic; 400
not what the source sends. Payload shapes follow each provider's documented webhook
bodies; the tests' fixtures are written from the same documents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from smtpguard.config import (
    ConfigError,
    EventsConfig,
    MailgunSource,
    PostmarkSource,
    SendgridSource,
    SesSource,
    SvixSource,
    read_secret,
)
from smtpguard.events import signatures
from smtpguard.events.sources.base import Nonce, Rejected, Source, Verified
from smtpguard.events.sources.mailgun import Mailgun
from smtpguard.events.sources.postmark import Postmark
from smtpguard.events.sources.sendgrid import SIGNATURE_HEADER, TIMESTAMP_HEADER, Sendgrid
from smtpguard.events.sources.ses import Ses, sns_canonical
from smtpguard.events.sources.svix import Svix

__all__ = [
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Mailgun",
    "Nonce",
    "Postmark",
    "Rejected",
    "Sendgrid",
    "Ses",
    "Source",
    "Sources",
    "Svix",
    "Verified",
    "build_sources",
    "sns_canonical",
]


# --- building them from the config -----------------------------------------------------------
@dataclass
class Sources:
    by_name: dict[str, Source] = field(default_factory=dict)

    def get(self, name: str) -> Source | None:
        return self.by_name.get(name)


def build_sources(events: EventsConfig, read: Callable[[Path], bytes] = Path.read_bytes) -> Sources:
    """Every source with its secret read now, so a missing one fails at start, not at the
    first webhook. Problems name the source's config path."""
    out = Sources()
    problems: list[str] = []
    for name, cfg in events.sources.items():
        where = f"events.sources.{name}"
        try:
            out.by_name[name] = _build(name, cfg, events.tolerance, where, read)
        except ConfigError as e:
            problems.extend(e.problems)
        except signatures.KeyProblem as e:
            problems.append(f"{where}: {e}")
    if problems:
        raise ConfigError(problems)
    return out


def _build(
    name: str,
    cfg: MailgunSource | SendgridSource | SvixSource | PostmarkSource | SesSource,
    tolerance: float,
    where: str,
    read: Callable[[Path], bytes],
) -> Source:
    def secret(env: str | None, file: Path | None) -> str:
        value = read_secret(env, file, where)
        assert value is not None  # the config demands one of the two
        return value

    if isinstance(cfg, MailgunSource):
        signing_key = secret(cfg.signing_key_env, cfg.signing_key_file)
        return Mailgun(name, cfg.provider, tolerance, signing_key)
    if isinstance(cfg, SendgridSource):
        key = signatures.sendgrid_key(secret(cfg.public_key_env, cfg.public_key_file))
        return Sendgrid(name, cfg.provider, tolerance, key)
    if isinstance(cfg, SvixSource):
        svix_secret = secret(cfg.secret_env, cfg.secret_file)
        signatures.svix_key(svix_secret)  # a secret that cannot verify anything is a config error
        return Svix(name, cfg.provider, tolerance, svix_secret)
    if isinstance(cfg, PostmarkSource):
        password = secret(cfg.password_env, cfg.password_file)
        return Postmark(name, cfg.provider, tolerance, cfg.username, password)
    try:
        pem = read(cfg.certificate_file)
    except OSError as e:
        raise ConfigError(
            [f"{where}.certificate_file: cannot read {cfg.certificate_file}: {e.strerror}"]
        ) from None
    return Ses(name, cfg.provider, tolerance, signatures.sns_certificates(pem), cfg.topic_arn)
