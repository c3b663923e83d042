"""`dns:`: the resolver every lookup uses."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator

from smtpguard.config.base import Duration, _Strict


def _nameserver(value: str) -> tuple[str, int]:
    """`127.0.0.1`, `127.0.0.1:5353`, `[::1]:5353` or `::1`: an IP literal (a resolver's own
    name would need a resolver to find it) and an optional port, 53 by default."""
    text = value.strip()
    host, port = text, 53
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"{value!r}: unclosed [")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ValueError(f"{value!r} is not [host]:port")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        if not port_text.isdigit():
            raise ValueError(f"{value!r} is not host:port")
        port = int(port_text)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"nameserver {value!r} must be an IP address, optionally with :port") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    return host, port


class DnsConfig(_Strict):
    """The resolver every lookup uses (doctor's checks, the RCPT recipient-domain check).
    Without `nameservers`, the system's (/etc/resolv.conf)."""

    nameservers: list[str] = Field(default_factory=list)
    timeout: Duration = Field(2.0, gt=0)
    """The whole lookup, every nameserver tried included: RCPT waits at most this long."""

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, v: list[str]) -> list[str]:
        for ns in v:
            _nameserver(ns)
        return v

    def servers(self) -> list[tuple[str, int]]:
        return [_nameserver(ns) for ns in self.nameservers]
