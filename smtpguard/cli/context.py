"""What every command shares: exit codes, the errors main() maps to them, --json output,
the operator's name in audits, and the config and store a command works on."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from smtpguard.config import DEFAULT_CONFIG, Config, load, read_secret
from smtpguard.policy.utc import iso_z
from smtpguard.store import Store, store_from_url

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORE = 4
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_FAILED: "refused or failed (bad config, unknown zone, a state that does not allow it)",
    EXIT_USAGE: "bad usage (unknown command or option, missing argument)",
    EXIT_NOT_FOUND: "no such record, queue entry or list entry",
    EXIT_STORE: "store unavailable, or no store at the configured path",
}
JSON_SCHEMA = 1
"""The version of every `--json` document (its `schema` key)."""


class CLIError(Exception):
    """A refused operation: printed as one line, exit code 1."""

    code = EXIT_FAILED


class UsageError(CLIError):
    """The arguments do not say what to do: exit code 2, as argparse's own errors."""

    code = EXIT_USAGE


class NotFound(CLIError):
    """No record (or entry) under that name: exit code 3, so a script can tell it from a
    store it could not read."""

    code = EXIT_NOT_FOUND


def emit(doc: dict[str, Any]) -> None:
    print(json.dumps({"schema": JSON_SCHEMA, **doc}, indent=2))


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return iso_z(epoch)


def actor() -> str:
    """Who a CLI change is audited as (DESIGN.md §14): `cli:USER@HOST`."""
    user = os.environ.get("SUDO_USER") or os.environ.get("USER") or "operator"
    return f"cli:{user}@{socket.gethostname()}"


def _config_path(args: argparse.Namespace) -> str:
    return getattr(args, "config", None) or os.environ.get("SMTPGUARD_CONFIG") or DEFAULT_CONFIG


def _config(args: argparse.Namespace) -> Config:
    return load(_config_path(args))


def on_store(config: Config, fn: Callable[[Store], Awaitable[T]], read_only: bool = False) -> T:
    """Run `fn` on the configured store, opened for this one call and closed after it, in
    the command's one event loop."""

    async def run() -> T:
        password = read_secret(config.store.password_env, config.store.password_file, "store")
        store = store_from_url(config.store.url, password=password, read_only=read_only, create=False)
        await store.open()
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


def _zone(config: Config, zone: str, allow_global: bool = False) -> str:
    if zone in config.zones or (allow_global and zone == "global"):
        return zone
    known = ", ".join(sorted(config.zones))
    raise CLIError(f"unknown zone {zone!r} (configured: {known})")
