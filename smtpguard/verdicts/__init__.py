"""Clients of the providers' log APIs (DESIGN.md §19): each asks its provider's documented
API and reduces the answer to the typed entries smtpguard.policy.verdicts judges.

Every client offers the same three calls:
- `entries(attempt)`: what the log holds that may be the attempt's message;
- `accepted_since(at)`: a few acceptances logged after `at` (the ingestion proof);
- `reported_since(since)`: bounces, complaints and unsubscribes for reconciliation.

`client_for(name, api, key)` builds one from config, imported on use (uvicorn's registry):
aiohttp is an optional dependency (the `events` extra), needed only when an api is configured.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smtpguard.config import Config
    from smtpguard.verdict_config import MailgunApi, PostmarkApi, SendgridApi
    from smtpguard.verdicts.model import LogApi

CLIENTS = {
    "mailgun": "smtpguard.verdicts.mailgun:MailgunLog",
    "postmark": "smtpguard.verdicts.postmark:PostmarkLog",
    "sendgrid": "smtpguard.verdicts.sendgrid:SendgridLog",
}


def client_for(provider: str, api: MailgunApi | PostmarkApi | SendgridApi, key: str, **kw: Any) -> LogApi:
    module, _, name = CLIENTS[api.kind].partition(":")
    cls = getattr(importlib.import_module(module), name)
    client: LogApi = cls.from_config(provider, api, key, **kw)
    return client


def api_key(api: MailgunApi | PostmarkApi | SendgridApi, what: str) -> str:
    """The api's key or token, read now from its environment variable or file."""
    from smtpguard.config import ConfigError, read_secret

    env = getattr(api, "key_env", None) or getattr(api, "token_env", None)
    file = getattr(api, "key_file", None) or getattr(api, "token_file", None)
    value = read_secret(env, file, what)
    if not value:
        raise ConfigError([f"{what}: the API key is empty"])
    return value


def clients_for(config: Config, **kw: Any) -> dict[str, LogApi]:
    """A log client per provider with an `api`, its key read now (a ConfigError naming the
    provider's api when the key is missing or empty). `kw` go to every client (`wall`: the
    Unix clock its searches end at, the one the verdicts are judged on)."""
    clients: dict[str, LogApi] = {}
    for i, p in enumerate(config.providers):
        api = getattr(p, "api", None)  # a Maildir provider has none
        if api is not None:
            clients[p.name] = client_for(p.name, api, api_key(api, f"providers[{i}].api"), **kw)
    return clients


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
    from smtpguard.config import ConfigError
    from smtpguard.policy.verdicts import log_identity

    try:
        key = api_key(api, what)
    except ConfigError:
        return None
    return log_identity(api.kind, api.url(api.kind), getattr(api, "domain", None), key)
