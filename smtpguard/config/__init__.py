"""Configuration: the schema of DESIGN.md §9, loaded from YAML and validated at load.

Every error names the YAML path and line (`zones.acme.users[0].password_hash (line 41): …`),
because an operator reading a failed `check-config` or a refused reload has only the file.
Unknown keys are errors: a misspelt `hourly_cap` must not silently mean "no cap"; nor may a
second `acme:` silently replace the first (duplicate keys are refused with both lines), nor
`hourly_cap: "20"` or `paused: "on"` be read as a number or a flag (types are strict).

One module a section (listener, store, event_key, dns, providers, queue, zones, events,
workers, verdicts) over `base` (the strict model, value types and errors); `schema` joins
them into Config with the checks that span sections; `loading` reads YAML into it;
`secrets` reads what the config names. This package re-exports every name, so
`from smtpguard.config import X` reads as it did when the config was one module.
"""

from __future__ import annotations

from smtpguard.config.base import (
    ConfigError,
    Duration,
    FieldProblem,
    FilePath,
    Rate,
    Size,
    _host_port,
    _Strict,
    is_loopback,
)
from smtpguard.config.dns import DnsConfig
from smtpguard.config.event_key import EventKeyConfig
from smtpguard.config.events import (
    SOURCE_KINDS,
    ConsoleConfig,
    EventsConfig,
    EventSource,
    MailboxConfig,
    MailgunSource,
    OperatorConfig,
    PostmarkSource,
    SendgridSource,
    SesSource,
    SideListenerLimits,
    SvixSource,
)
from smtpguard.config.listener import LimitsConfig, ListenerConfig, TLSFiles
from smtpguard.config.loading import LoadedConfig, load, loads, parse_yaml
from smtpguard.config.outbox import OutboxSource
from smtpguard.config.providers import (
    MIN_PROBE_INTERVAL,
    BreakerConfig,
    MaildirProviderConfig,
    ProviderConfig,
    SmtpProviderConfig,
    Timeouts,
)
from smtpguard.config.queue import Backoff, MessageClass, QueueConfig
from smtpguard.config.schema import Config, LogConfig, MetricsConfig
from smtpguard.config.secrets import outbox_password, outbox_secrets, provider_secrets, read_secret
from smtpguard.config.store import STORE_SCHEMES, StoreConfig, StoreWait
from smtpguard.config.workers import MAX_WORKERS, worker_count
from smtpguard.config.zones import UserConfig, ZoneConfig, plan_send_as

DEFAULT_CONFIG = "conf/smtpguard.yaml"

__all__ = [
    "DEFAULT_CONFIG",
    "MAX_WORKERS",
    "MIN_PROBE_INTERVAL",
    "SOURCE_KINDS",
    "STORE_SCHEMES",
    "Backoff",
    "BreakerConfig",
    "Config",
    "ConfigError",
    "ConsoleConfig",
    "DnsConfig",
    "Duration",
    "EventKeyConfig",
    "EventSource",
    "EventsConfig",
    "FieldProblem",
    "FilePath",
    "LimitsConfig",
    "ListenerConfig",
    "LoadedConfig",
    "LogConfig",
    "MailboxConfig",
    "MaildirProviderConfig",
    "MailgunSource",
    "MessageClass",
    "MetricsConfig",
    "OperatorConfig",
    "OutboxSource",
    "PostmarkSource",
    "ProviderConfig",
    "QueueConfig",
    "Rate",
    "SendgridSource",
    "SesSource",
    "SideListenerLimits",
    "Size",
    "SmtpProviderConfig",
    "StoreConfig",
    "StoreWait",
    "SvixSource",
    "TLSFiles",
    "Timeouts",
    "UserConfig",
    "ZoneConfig",
    "_Strict",
    "_host_port",
    "is_loopback",
    "load",
    "loads",
    "outbox_password",
    "outbox_secrets",
    "parse_yaml",
    "plan_send_as",
    "provider_secrets",
    "read_secret",
    "worker_count",
]
