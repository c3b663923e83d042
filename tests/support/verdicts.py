"""What the verdict-loop tests and bench/verdicts.py share: a guard config whose provider
has a log `api` pointing at a local fake, and the provider's side of a relayed message (its
tag and Message-ID as the sink received them, for the fake's log)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support import Received, base_config

API_KEY = "key-0123456789abcdef-verdicts"
API_ENV = "SMTPGUARD_TEST_LOG_API_KEY"
MAILGUN_DOMAIN = "mg.acme.example"


def api_section(kind: str, base_url: str) -> dict[str, Any]:
    secret = {"postmark": "token_env"}.get(kind, "key_env")
    api: dict[str, Any] = {"kind": kind, secret: API_ENV, "base_url": base_url}
    if kind == "mailgun":
        api["domain"] = MAILGUN_DOMAIN
    return api


def verdict_config(
    tmp: Path, upstream_port: int, store_url: str, kind: str, base_url: str, **overrides: Any
) -> dict[str, Any]:
    """base_config with the provider's `api`, the §19 defaults spelt out, and the store."""
    cfg = base_config(tmp, upstream_port, **overrides)
    cfg["store"] = {"url": store_url, **({"unsafe": True} if store_url.startswith("redis") else {})}
    cfg["providers"][0]["api"] = api_section(kind, base_url)
    cfg["verdicts"] = {"after": "2m", "every": "5m", "absent_after": "30m", "give_up": "24h"}
    return cfg


def tag_of(received: Received, kind: str) -> str | None:
    """smtpguard's tag as the provider reads it from the relayed message."""
    if kind == "postmark":
        return received.header("X-PM-Metadata-smtpguard_key")
    raw = received.header({"mailgun": "X-Mailgun-Variables", "sendgrid": "X-SMTPAPI"}[kind])
    if raw is None:
        return None
    doc = json.loads(raw)
    value = doc.get("unique_args", {}) if kind == "sendgrid" else doc
    tag = value.get("smtpguard_key")
    return tag if isinstance(tag, str) else None


def message_id_of(received: Received) -> str:
    mid = received.header("Message-ID")
    assert mid is not None, "every relayed message carries a Message-ID"
    return mid
