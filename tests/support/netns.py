"""Run a module of tests/support in a network namespace of its own (`unshare -n`, as root,
which CI is), with extra addresses on its loopback device: tests that need clients from
several addresses (one IPv6 /64, remote IPv4 peers) never change the host's network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_in_namespace(module: str, addresses: Sequence[str]) -> Any:
    """`python -m module` in a new network namespace whose loopback also holds `addresses`
    (CIDR notation); what the module printed as JSON."""
    assert os.geteuid() == 0, "needs root for a network namespace (scripts/test runs as root in CI)"
    adds = "; ".join(f"ip addr add {a} dev lo{' nodad' if ':' in a else ''}" for a in addresses)
    script = f"set -e; ip link set lo up; {adds}; exec {sys.executable} -m {module}"
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
