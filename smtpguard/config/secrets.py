"""Secrets named by the config: read from the environment or a file, never inline."""

from __future__ import annotations

import os
from pathlib import Path

from smtpguard.config.base import ConfigError
from smtpguard.config.outbox import OutboxSource
from smtpguard.config.providers import SmtpProviderConfig
from smtpguard.config.schema import Config
from smtpguard.config.verdicts import MailgunApi, PostmarkApi, SendgridApi
from smtpguard.policy.verdicts import log_identity


def read_secret(env: str | None, file: Path | None, what: str) -> str | None:
    """A secret from the environment or a file (trailing newline stripped); never inline."""
    if env:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError([f"{what}: environment variable {env} is not set"])
        return value
    if file:
        try:
            return file.read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as e:
            raise ConfigError([f"{what}: cannot read {file}: {e.strerror}"]) from None
    return None


def outbox_password(name: str, src: OutboxSource) -> str | None:
    """One outbox source's password; a missing variable or file is a ConfigError naming it."""
    return read_secret(src.password_env, src.password_file, f"outbox.{name}")


def outbox_secrets(config: Config) -> dict[str, str | None]:
    """Every outbox source's password now: at start, at check-config and on each SIGHUP (a
    file rewritten in place is a rotation), a missing one naming its source."""
    out: dict[str, str | None] = {}
    problems: list[str] = []
    for name, src in config.outbox.items():
        try:
            out[name] = outbox_password(name, src)
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    return out


def provider_secrets(config: Config) -> dict[str, str | None]:
    """Resolve every provider's password now, so a missing one fails at start, not at send."""
    out: dict[str, str | None] = {}
    problems: list[str] = []
    for i, p in enumerate(config.providers):
        if isinstance(p, SmtpProviderConfig):
            try:
                out[p.name] = read_secret(p.password_env, p.password_file, f"providers[{i}]")
            except ConfigError as e:
                problems.extend(e.problems)
        else:
            out[p.name] = None
    if problems:
        raise ConfigError(problems)
    return out


def api_key(api: MailgunApi | PostmarkApi | SendgridApi, what: str) -> str:
    """The api's key or token, read now from its environment variable or file."""
    env = getattr(api, "key_env", None) or getattr(api, "token_env", None)
    file = getattr(api, "key_file", None) or getattr(api, "token_file", None)
    value = read_secret(env, file, what)
    if not value:
        raise ConfigError([f"{what}: the API key is empty"])
    return value


def logs_of(config: Config) -> dict[str, str]:
    """Provider name → the log its `api` names (policy.verdicts.log_identity), its key read
    now: what the relay notes with each attempt's data_sent, and what a client built now
    reads. A key that cannot be read names none: no absence is proved then."""
    logs: dict[str, str] = {}
    for i, p in enumerate(config.providers):
        api = getattr(p, "api", None)  # a Maildir provider has none
        named = log_of(api, f"providers[{i}].api") if api is not None else None
        if named is not None:
            logs[p.name] = named
    return logs


def log_of(api: MailgunApi | PostmarkApi | SendgridApi, what: str) -> str | None:
    """The log `api` names with its key as read now; None when the key cannot be read."""
    try:
        key = api_key(api, what)
    except ConfigError:
        return None
    return log_identity(api.kind, api.url(api.kind), getattr(api, "domain", None), key)
