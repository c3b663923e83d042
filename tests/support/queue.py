"""The store-and-forward guard that the kill -9 tests start as a process of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support import base_config


def killable_queue_config(
    tmp: Path,
    upstream_port: int,
    port: int,
    *,
    store_url: str | None = None,
    instance: str | None = None,
    workers: int = 4,
    poll_interval: str = "100ms",
) -> dict[str, Any]:
    """Zone `acme` in queue mode on `port`: caps far out of the way, a 1 s lease so that what
    a killed process held is claimed again soon, and a short backoff, so a test of a few
    seconds sees every entry settle."""
    cfg = base_config(
        tmp,
        upstream_port,
        zones__acme__delivery="queue",
        zones__acme__hourly_cap=100_000,
        zones__acme__monthly_cap=1_000_000,
    )
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    if store_url is not None:
        cfg["store"] = {"url": store_url}
    if instance is not None:
        cfg["instance"] = instance
    cfg["event_key"] = {"inflight_wait": "200ms", "min_retry_interval": "60s", "lease": "1s", "strip": False}
    cfg["queue"] = {
        "backoff": {"base": "100ms", "max": "500ms"},
        "workers": workers,
        "poll_interval": poll_interval,
    }
    return cfg
