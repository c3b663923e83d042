"""Remote clients cannot starve this host's health checks: the metrics listener keeps
loopback's connections out of its 128-connection total (a share of 32 of their own), so
four remote addresses holding 32 trickling connections each fill the total and a fifth
remote address is turned away, while /healthz from loopback and `smtpguard healthcheck`
(the container's HEALTHCHECK) are answered.

The remote addresses need a loopback of their own: the check runs in a network namespace
(`unshare -n`, as root, which CI is), so the host's network is never changed."""

from __future__ import annotations

from tests.support.metrics_share import ATTACKERS, LATE
from tests.support.netns import run_in_namespace


def test_remote_connections_filling_the_metrics_listener_leave_loopback_checks_answered() -> None:
    seen = run_in_namespace("tests.support.metrics_share", [f"{a}/32" for a in (*ATTACKERS, LATE)])
    assert seen["full"] == 128, seen
    assert seen["local"] == ["200"] * 10, seen
    assert seen["healthcheck"] == 0, seen
    assert seen["late"] != "200", seen
