"""Hypothesis profiles for the stateful ledger test (tests/invariants/test_stateful.py).

`ci` is the default: a bounded search that fits a test run. `long` searches much further
(scripts/stateful). Choose with `--hypothesis-profile=NAME` (pytest needs this module loaded
as a plugin to know the names before it configures Hypothesis: `-p tests.support.hypothesis_profiles`,
as scripts/stateful does) or with HYPOTHESIS_PROFILE=NAME.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_COMMON = {
    # No explain phase: once a run has failed it traces every later example, which makes
    # shrinking these multi-second sequences too slow to finish.
    "phases": (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    "print_blob": True,
}

settings.register_profile("ci", max_examples=40, stateful_step_count=30, **_COMMON)
# SMTPGUARD_LONG_EXAMPLES: fewer examples of the long sequences when a run has less time.
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("SMTPGUARD_LONG_EXAMPLES", "2000")),
    stateful_step_count=60,
    **_COMMON,
)

PROFILES = ("ci", "long")


def stateful_settings() -> settings:
    """The loaded profile if it is one of ours, else HYPOTHESIS_PROFILE, else `ci`."""
    current = settings.get_current_profile_name()
    name = current if current in PROFILES else os.environ.get("HYPOTHESIS_PROFILE", "ci")
    return settings.get_profile(name)
