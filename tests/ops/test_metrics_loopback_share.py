"""Remote clients cannot starve this host's health checks: the metrics listener keeps
loopback's connections out of its 128-connection total (a share of 32 of their own), so
four remote addresses holding 32 trickling connections each fill the total and a fifth
remote address is turned away, while /healthz from loopback and `smtpguard healthcheck`
(the container's HEALTHCHECK) are answered.

The remote addresses need a loopback of their own: the check runs in a network namespace
(`unshare -n`, as root, which CI is), so the host's network is never changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.metrics_share import ATTACKERS, LATE

ROOT = Path(__file__).resolve().parents[2]


def test_remote_connections_filling_the_metrics_listener_leave_loopback_checks_answered() -> None:
    assert os.geteuid() == 0, "needs root for a network namespace (scripts/test runs as root in CI)"
    addresses = " ".join([*ATTACKERS, LATE])
    script = (
        "set -e; ip link set lo up; "
        f"for a in {addresses}; do ip addr add $a/32 dev lo; done; "
        f"exec {sys.executable} -m tests.support.metrics_share"
    )
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen["full"] == 128, seen
    assert seen["local"] == ["200"] * 10, seen
    assert seen["healthcheck"] == 0, seen
    assert seen["late"] != "200", seen
