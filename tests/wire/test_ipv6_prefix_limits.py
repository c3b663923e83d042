"""One client holds a whole IPv6 /64: the SMTP listener counts AUTH failures and connections
per /64, as the console and the side listeners do, not per address (which would give it
`auth_failures` guesses and `max_connections_per_ip` connections 2^64 times over).

Twelve addresses of one /64 need a loopback of their own: the check runs in a network
namespace (`unshare -n`, as root, which CI is), so the host's network is never changed."""

from __future__ import annotations

from tests.support.ipv6_prefix import ADDRESSES
from tests.support.netns import run_in_namespace


def test_auth_failures_and_connections_are_counted_per_ipv6_64() -> None:
    seen = run_in_namespace("tests.support.ipv6_prefix", [f"{a}/64" for a in ADDRESSES])
    # 60 guesses from the /64 with auth_failures 3: two 535, the third failure and every
    # later guess 421 (locked out, the password never checked).
    assert seen["auth"] == {"535": 2, "421": 58}, seen
    # 36 connections held open from the /64 with max_connections_per_ip 2: two greeted.
    assert seen["greetings"] == {"220": 2, "421": 34}, seen
    assert seen["upstream"] == 0
