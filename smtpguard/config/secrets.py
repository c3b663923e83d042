"""Secrets named by the config: read from the environment or a file, never inline."""

from __future__ import annotations

import os
from pathlib import Path

from smtpguard.config.base import ConfigError
from smtpguard.config.providers import SmtpProviderConfig
from smtpguard.config.schema import Config


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
