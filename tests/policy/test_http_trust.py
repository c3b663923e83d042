"""policy/http_trust.py: whom a request is from behind trusted proxies, and whether its Host
is ours. Pure, no sockets; the console's wiring is tests/console/test_console_trust.py."""

from __future__ import annotations

import pytest

from smtpguard.policy.http_trust import (
    client_address,
    host_allowed,
    host_port,
    limit_unit,
    network,
    request_host,
)

PROXIES = [network("10.0.0.0/8"), network("127.0.0.2"), network("fd00::/8")]


@pytest.mark.parametrize(
    ("peer", "xff", "client"),
    [
        # Not a trusted peer: the header is never read.
        ("192.0.2.1", ["203.0.113.5"], "192.0.2.1"),
        ("::ffff:192.0.2.1", ["203.0.113.5"], "192.0.2.1"),
        # A trusted peer: the right-most address that is not a trusted proxy.
        ("127.0.0.2", ["203.0.113.5"], "203.0.113.5"),
        ("127.0.0.2", ["198.51.100.1, 203.0.113.5"], "203.0.113.5"),
        ("127.0.0.2", ["198.51.100.1", "203.0.113.5, 10.1.2.3"], "203.0.113.5"),
        ("::ffff:10.0.0.9", ["203.0.113.5, 10.1.2.3"], "203.0.113.5"),
        ("fd00::1", ["2001:db8::5"], "2001:db8::5"),
        ("127.0.0.2", ["[2001:db8::5]:4711"], "2001:db8::5"),
        ("127.0.0.2", ["203.0.113.5:4711"], "203.0.113.5"),
        # No header, or every hop a proxy: the left-most known hop.
        ("127.0.0.2", [], "127.0.0.2"),
        ("127.0.0.2", ["10.1.1.1, 10.2.2.2"], "10.1.1.1"),
        # A hop that is not an address stops at the last one a proxy vouched for.
        ("127.0.0.2", ["203.0.113.5, unknown"], "127.0.0.2"),
        ("127.0.0.2", ["unknown, 10.1.2.3"], "10.1.2.3"),
        ("127.0.0.2", ["garbage, 203.0.113.5"], "203.0.113.5"),
    ],
)
def test_client_address(peer: str, xff: list[str], client: str) -> None:
    assert client_address(peer, xff, PROXIES) == client


@pytest.mark.parametrize(
    ("client", "unit"),
    [
        ("203.0.113.5", "203.0.113.5"),
        ("::ffff:203.0.113.5", "203.0.113.5"),
        # One IPv6 client holds its /64: every address of it, scoped or not, is one count.
        ("2001:db8:0:1::5", "2001:db8:0:1::/64"),
        ("2001:db8:0:1:ffff:ffff:ffff:ffff", "2001:db8:0:1::/64"),
        ("[2001:db8:0:1::5]:4711", "2001:db8:0:1::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("fe80::1%other", "fe80::/64"),
        ("2001:db8:0:2::5", "2001:db8:0:2::/64"),
        ("?", "?"),
    ],
)
def test_the_unit_a_per_address_limit_counts(client: str, unit: str) -> None:
    assert limit_unit(client) == unit


def test_no_trusted_proxies_means_the_peer() -> None:
    assert client_address("127.0.0.2", ["203.0.113.5"], []) == "127.0.0.2"


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("Console.Example.COM.", ("console.example.com", None)),
        ("console.example.com:8443", ("console.example.com", 8443)),
        ("127.0.0.1:9590", ("127.0.0.1", 9590)),
        ("127.0.0.1:", ("127.0.0.1", None)),
        ("[::1]", ("::1", None)),
        ("[0:0:0::1]:9590", ("::1", 9590)),
        ("[2001:DB8::7]", ("2001:db8::7", None)),
    ],
)
def test_host_port(value: str, parsed: tuple[str, int | None]) -> None:
    assert host_port(value) == parsed


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "empty"),
        ("::1", "brackets"),
        ("[::1", "does not close"),
        ("[example.com]", "not an IPv6"),
        ("[::1]x", "no valid port"),
        ("a b", "not a host name"),
        ("host:99999", "no valid port"),
        ("host:80x", "no valid port"),
        ("host:\u0668\u0660", "no valid port"),
        ("host:0000065536", "no valid port"),
        ("-bad-.example", "not a host name"),
        ("a..b", "not a host name"),
    ],
)
def test_bad_hosts_say_why(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        host_port(value)


def test_host_allowed_by_name_and_port() -> None:
    allowed = [("console.example.com", None), ("alt.example", 8443), ("tls.example", 443)]
    assert host_allowed("tls.example", 443, allowed)
    assert host_allowed("tls.example", None, allowed)  # the browser left the default out
    assert not host_allowed("tls.example", 8443, allowed)
    assert host_allowed("console.example.com", 1234, allowed)
    assert host_allowed("console.example.com", None, allowed)
    assert host_allowed("alt.example", 8443, allowed)
    assert not host_allowed("alt.example", 8444, allowed)
    assert not host_allowed("alt.example", None, allowed)
    assert not host_allowed("evil.example", None, allowed)


@pytest.mark.parametrize(
    ("value", "problem"), [("10.0.0.1/8", "host bits set; the network is 10.0.0.0/8"), ("proxy", "CIDR")]
)
def test_bad_networks_say_why(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        network(value)


def test_a_proxy_written_ipv4_mapped_is_its_ipv4_network() -> None:
    assert str(network("::ffff:10.0.0.7")) == "10.0.0.7/32"
    assert str(network("::ffff:10.0.0.0/104")) == "10.0.0.0/8"
    assert client_address("::ffff:10.0.0.7", ["203.0.113.5"], [network("::ffff:10.0.0.7")]) == "203.0.113.5"
    # Wider than the mapped range: an IPv6 network like any other.
    assert str(network("::/64")) == "::/64"


@pytest.mark.parametrize(
    ("target", "hosts", "want"),
    [
        ("/login", ["Console.Example.:8443"], ("console.example", 8443)),
        ("*", ["[::1]"], ("::1", None)),
        # The absolute form is judged by its own authority, userinfo dropped; Host ignored.
        ("http://attacker.example/login", ["127.0.0.1"], ("attacker.example", None)),
        ("http://127.0.0.1@attacker.example:81/", ["127.0.0.1"], ("attacker.example", 81)),
        ("HTTP://attacker.example@127.0.0.1/", [], ("127.0.0.1", None)),
        ("/login", [], "no Host header"),
        ("/login", ["127.0.0.1", "attacker.example"], "2 Host headers"),
        ("http:///login", ["127.0.0.1"], "an empty host"),
        ("/login", ["u@127.0.0.1"], "not a host name"),
    ],
)
def test_the_host_a_request_is_judged_by(target: str, hosts: list[str], want: object) -> None:
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            request_host(target, hosts)
    else:
        assert request_host(target, hosts) == want
