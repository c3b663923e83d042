"""The VERP key of `events.mailbox` (DESIGN.md §18): its domain and secret, read once at
start (the mailbox's settings need a restart), shared by the relay, which signs envelope
senders with it, and the mailbox, which verifies the reports mailed back."""

from __future__ import annotations

from dataclasses import dataclass, field

from smtpguard.config import Config, ConfigError, read_secret

SECRET_MIN = 16
"""Bytes: 128 bits at the very least (`openssl rand -hex 32` gives 64 characters)."""


@dataclass(frozen=True, slots=True)
class VerpKey:
    domain: str
    secret: bytes = field(repr=False)


def verp_key(config: Config) -> VerpKey | None:
    """The configured key, or None without `events.mailbox.domain`. A missing or empty
    secret is a config error now, not unsigned mail later."""
    mailbox = config.events.mailbox if config.events is not None else None
    if mailbox is None or mailbox.domain is None:
        return None
    secret = read_secret(mailbox.secret_env, mailbox.secret_file, "events.mailbox")
    if not secret:
        raise ConfigError(["events.mailbox: the VERP secret is empty"])
    key = secret.encode()
    if len(key) < SECRET_MIN:
        # Every recipient sees a token and its sg id in Return-Path: a short secret is found
        # offline from one of them, and then any token can be made.
        raise ConfigError(
            [f"events.mailbox: the VERP secret is {len(key)} bytes; it needs at least {SECRET_MIN}"]
        )
    return VerpKey(mailbox.domain, key)
