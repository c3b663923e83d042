"""What an HTTP request may be believed about (DESIGN.md §18, "The console"): the address of
the client behind trusted proxies, and whether the name it was sent to is ours.

`X-Forwarded-For` is written by whoever sends it: only a peer the operator named as a proxy
is believed, and of its list only the right-most address that is not itself a trusted proxy
(everything left of that was written by the client). The Host check refuses DNS rebinding:
a page on an attacker's name that resolves to the console's address is sent with the
attacker's name as its Host.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
WILDCARDS = frozenset({"0.0.0.0", "::"})
"""Listen addresses no browser is sent to by name: a console on them answers console.hosts."""
DEFAULT_PORTS = (80, 443)


def network(value: str) -> Network:
    """A trusted proxy's network, written `10.0.0.0/8` or one address (`10.0.0.7`). One
    written IPv4-mapped (`::ffff:10.0.0.7`, as a dual-stack socket shows an IPv4 peer) is
    that IPv4 network: peers are compared as IPv4 (address())."""
    try:
        net = ipaddress.ip_network(value.strip(), strict=True)
    except ValueError as e:
        if "host bits set" in str(e):
            loose = ipaddress.ip_network(value.strip(), strict=False)
            raise ValueError(f"{value!r} has host bits set; the network is {loose}") from None
        raise ValueError(f"{value!r} is not an IP address or network (CIDR)") from None
    mapped = net.network_address.ipv4_mapped if isinstance(net, ipaddress.IPv6Network) else None
    if mapped is not None and net.prefixlen >= 96:
        return ipaddress.IPv4Network((mapped, net.prefixlen - 96))
    return net


def address(value: str) -> Address | None:
    """An address as a peer or a proxy gives it (`[v6]:port`, `v4:port` too), or None."""
    v = value.strip()
    if v.startswith("["):
        v = v[1 : v.find("]")] if "]" in v else ""
    elif v.count(":") == 1:
        v = v.split(":", 1)[0]
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        return None
    # A dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d; the operator writes a.b.c.d.
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def client_address(peer: str, forwarded_for: Iterable[str], trusted: Sequence[Network]) -> str:
    """Whom a request is from: the TCP peer, unless the peer is a trusted proxy; then the
    right-most address of `forwarded_for` (every X-Forwarded-For line, in order) that is
    not a trusted proxy. A hop that is not an address stops the walk at the last hop known:
    a proxy wrote that position, so the fault is the proxy's and its bucket is the safe one."""
    peer_ip = address(peer)
    if peer_ip is None or not _trusted(peer_ip, trusted):
        return str(peer_ip) if peer_ip is not None else peer
    hops = [hop for line in forwarded_for for hop in line.split(",") if hop.strip()]
    known = peer_ip
    for hop in reversed(hops):
        ip = address(hop)
        if ip is None:
            return str(known)
        known = ip
        if not _trusted(ip, trusted):
            return str(ip)
    return str(known)


IPV6_CLIENT_PREFIX = 64
"""What one IPv6 client holds: a /64 is a single LAN's or subscriber's (RFC 6177), and
its privacy addresses (RFC 8981) change by themselves."""


def limit_unit(client: str) -> str:
    """What a per-address limit counts for `client` (as client_address() or a connection's
    peer gives it): the address for IPv4, its /64 for IPv6, so that one client cannot start
    a fresh count from each of the addresses it holds. Used by the console's login limits
    and every side listener's connection caps. Anything that is not an address is counted
    as itself."""
    ip = address(client)
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, IPV6_CLIENT_PREFIX), strict=False))
    return str(ip) if ip is not None else client


def _trusted(ip: Address, trusted: Sequence[Network]) -> bool:
    return any(ip.version == net.version and ip in net for net in trusted)


def host_port(value: str) -> tuple[str, int | None]:
    """A Host header (or a console.hosts entry) as (normalised host, port or None).

    Names are compared without case and without a trailing dot; IPv6 addresses need their
    brackets (RFC 3986 §3.2.2) and compare as addresses, so `[0:0::1]` is `[::1]`.
    """
    v = value.strip()
    if not v:
        raise ValueError("an empty host")
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            raise ValueError(f"{value!r} opens a [ that it does not close")
        try:
            host = str(ipaddress.IPv6Address(v[1:end]))
        except ValueError:
            raise ValueError(f"{value!r}: {v[1:end]!r} is not an IPv6 address") from None
        rest = v[end + 1 :]
    else:
        if v.count(":") > 1:
            raise ValueError(f"{value!r}: an IPv6 address must be in brackets, [{v}]")
        name, sep, port = v.partition(":")
        host, rest = name.lower().removesuffix("."), sep + port
        if not all(_LABEL.fullmatch(label) for label in host.split(".")):
            raise ValueError(f"{value!r} is not a host name or address")
    if not rest or rest == ":":
        return host, None
    digits = rest[1:]
    ok = rest.startswith(":") and digits.isascii() and digits.isdigit() and len(digits) <= 5
    if not ok or int(digits) > 65535:
        raise ValueError(f"{value!r} has no valid port after the host")
    return host, int(digits)


def request_host(target: str, host_headers: Sequence[str]) -> tuple[str, int | None]:
    """The (host, port) a request is addressed to, as host_port() gives it; ValueError
    naming the problem when there is not exactly one. The absolute form of the target names
    the host itself and the Host header is ignored (RFC 9112 §3.2.2): a proxy's client
    could otherwise send one name and be judged by another."""
    if not target.startswith("/") and target != "*":
        authority = urlsplit(target).netloc.rpartition("@")[2]
    elif not host_headers:
        raise ValueError("the request has no Host header")
    elif len(host_headers) > 1:
        raise ValueError(f"the request has {len(host_headers)} Host headers")
    else:
        authority = host_headers[0]
    try:
        return host_port(authority)
    except ValueError as e:
        raise ValueError(f"bad Host header: {e}") from None


def host_allowed(host: str, port: int | None, allowed: Iterable[tuple[str, int | None]]) -> bool:
    """An entry without a port allows its host at any port (a proxy or an SSH tunnel may
    forward from another port; the port does nothing against rebinding, the name does). A
    Host without a port is the scheme's default, which a browser leaves out: behind a proxy
    the console cannot tell http from https, so an entry for 80 or 443 allows it."""
    return any(
        host == h and (p is None or p == port or (port is None and p in DEFAULT_PORTS)) for h, p in allowed
    )
