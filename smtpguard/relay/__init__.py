"""Relaying one reserved submission: providers, their connection pools, the route (DESIGN.md §6).

base.py is the seam (Envelope, Provider); smtp.py and maildir.py are the provider kinds,
route.py walks them. What each provider answer means, and whether the next provider may be
tried, is policy/failover.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

from smtpguard.config import MaildirProviderConfig, SmtpProviderConfig
from smtpguard.policy.failover import Attempted, Health
from smtpguard.relay.base import BeforeData, Envelope, MarkSent, Provider
from smtpguard.relay.maildir import MaildirProvider, _maildir_message, _maildir_write
from smtpguard.relay.route import Route
from smtpguard.relay.smtp import SmtpProvider

__all__ = [
    "Attempted",
    "BeforeData",
    "Envelope",
    "Health",
    "MaildirProvider",
    "MarkSent",
    "Provider",
    "Route",
    "SmtpProvider",
    "_maildir_message",
    "_maildir_write",
    "build_providers",
]


def build_providers(
    configs: Sequence[SmtpProviderConfig | MaildirProviderConfig],
    secrets: dict[str, str | None],
    helo: str,
    event_tags: dict[str, str] | None = None,
    logs: dict[str, str] | None = None,
) -> list[Provider]:
    """`event_tags`, `logs`: by provider name, the kind of tag it writes and the log its api
    names (server/reload.py _event_tags, _logs)."""
    out: list[Provider] = []
    tags, named = event_tags or {}, logs or {}
    for cfg in configs:
        if isinstance(cfg, SmtpProviderConfig):
            out.append(
                SmtpProvider(cfg, secrets.get(cfg.name), helo, tags.get(cfg.name), named.get(cfg.name))
            )
        else:
            out.append(MaildirProvider(cfg))
    return out
