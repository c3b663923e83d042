"""The verdict settings (DESIGN.md §19) now live in smtpguard/config/verdicts.py; this
module keeps `from smtpguard.verdict_config import X` working."""

from smtpguard.config.verdicts import (
    DEFAULT_BASE_URLS,
    MIN_EVERY,
    ApiConfig,
    MailgunApi,
    PostmarkApi,
    ReconcileConfig,
    SendgridApi,
    VerdictsConfig,
    _Api,
    api_problem,
)

__all__ = [
    "DEFAULT_BASE_URLS",
    "MIN_EVERY",
    "ApiConfig",
    "MailgunApi",
    "PostmarkApi",
    "ReconcileConfig",
    "SendgridApi",
    "VerdictsConfig",
    "_Api",
    "api_problem",
]
