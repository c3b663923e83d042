"""One client holds a whole IPv6 /64: the SMTP listener counts AUTH failures and connections
per /64, as the console and the side listeners do, not per address (which would give it
`auth_failures` guesses and `max_connections_per_ip` connections 2^64 times over).

Twelve addresses of one /64 need a loopback of their own: the check runs in a network
namespace (`unshare -n`, as root, which CI is), so the host's network is never changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.ipv6_prefix import ADDRESSES

ROOT = Path(__file__).resolve().parents[2]


def test_auth_failures_and_connections_are_counted_per_ipv6_64() -> None:
    assert os.geteuid() == 0, "needs root for a network namespace (scripts/test runs as root in CI)"
    addresses = " ".join(ADDRESSES)
    script = (
        "set -e; ip link set lo up; "
        f"for a in {addresses}; do ip -6 addr add $a/64 dev lo nodad; done; "
        f"exec {sys.executable} -m tests.support.ipv6_prefix"
    )
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    # 60 guesses from the /64 with auth_failures 3: two 535, the third failure and every
    # later guess 421 (locked out, the password never checked).
    assert seen["auth"] == {"535": 2, "421": 58}, seen
    # 36 connections held open from the /64 with max_connections_per_ip 2: two greeted.
    assert seen["greetings"] == {"220": 2, "421": 34}, seen
    assert seen["upstream"] == 0
