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

from smtpguard.config.secrets import api_key as api_key
from smtpguard.config.secrets import log_of as log_of
from smtpguard.config.secrets import logs_of as logs_of

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
