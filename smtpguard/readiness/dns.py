"""Every DNS query smtpguard makes goes through here: dnspython's async resolver, pointed at
`dns.nameservers` when configured (tests and air-gapped sites run their own resolver), else
at the system's. Answers come back as policy/dnsdata.py's plain `Lookup`; no exception from
dnspython leaves this module.
"""

from __future__ import annotations

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.nameserver
import dns.rcode
import dns.rdatatype
import dns.resolver
import dns.rrset

from smtpguard.config import DnsConfig
from smtpguard.policy.dnsdata import Lookup


class DnsClient:
    def __init__(self, cfg: DnsConfig, resolv_conf: str = "/etc/resolv.conf") -> None:
        servers = cfg.servers()
        self.config = cfg
        self.problem = ""
        """Why no lookup can be made (no resolver configured); every lookup is then an
        error, which RCPT accepts and doctor reports, rather than serve failing to start."""
        if servers:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [dns.nameserver.Do53Nameserver(host, port) for host, port in servers]
        else:
            try:
                resolver = dns.asyncresolver.Resolver(filename=resolv_conf)
            except dns.resolver.NoResolverConfiguration as e:
                resolver = dns.asyncresolver.Resolver(configure=False)
                self.problem = f"no resolver: {resolv_conf} gives no nameserver ({e}); set dns.nameservers"
        # `lifetime` bounds the whole lookup (every server, every retry): what a RCPT waits at
        # most. Each try gets half of its server's share, so a UDP answer lost once is asked
        # again within the lifetime instead of ending the lookup as a timeout.
        resolver.lifetime = cfg.timeout
        resolver.timeout = cfg.timeout / (2 * max(len(servers), 1))
        resolver.cache = None  # callers keep what they need for the TTL they are given
        self._resolver = resolver
        self.timeout = cfg.timeout

    @staticmethod
    def encode(name: str) -> dns.name.Name:
        """`name` as DNS labels, by IDNA 2008 (UTS 46 mapping, non-transitional:
        `straße.de` stays `xn--strae-oqa.de`). Passed explicitly: dnspython's default is
        IDNA 2003 (`strasse.de`, another domain) unless the `idna` package happens to be
        importable."""
        return dns.name.from_text(name, idna_codec=dns.name.IDNA_2008_Practical)

    async def lookup(self, rdtype: str, name: str) -> Lookup:
        if self.problem:
            return Lookup("error", detail=self.problem)
        try:
            qname = self.encode(name)
        except (dns.exception.DNSException, UnicodeError, ValueError) as e:
            # A name IDNA 2008 cannot encode: "error", so the callers accept (DNS trouble
            # never blocks mail) rather than refuse a domain that was never looked up.
            return Lookup("error", detail=f"{name!r} cannot be encoded (IDNA 2008): {e}"[:200])
        try:
            answer = await self._resolver.resolve(qname, rdtype, raise_on_no_answer=False, search=False)
        except dns.resolver.NXDOMAIN as e:
            return Lookup("nxdomain", ttl=_negative_ttl(_first_response(e)))
        except dns.resolver.LifetimeTimeout:
            return Lookup("error", detail="timeout")
        except dns.resolver.NoNameservers as e:
            return Lookup("error", detail=_rcode_of(e))
        except dns.exception.DNSException as e:
            return Lookup("error", detail=f"{type(e).__name__}: {e}"[:200])
        except OSError as e:
            return Lookup("error", detail=e.strerror or str(e))
        if answer.rrset is None:
            return Lookup("nodata", ttl=_negative_ttl(answer.response))
        return Lookup("ok", tuple(_texts(answer.rrset)), ttl=float(answer.rrset.ttl))


def _texts(rrset: dns.rrset.RRset) -> list[str]:
    out = []
    for rd in rrset:
        if rrset.rdtype == dns.rdatatype.TXT:
            # RFC 7208 §3.3 and RFC 6376 §3.6.2.2: the strings of one record are one text.
            out.append(b"".join(rd.strings).decode("utf-8", "replace"))
        elif rrset.rdtype == dns.rdatatype.MX:
            exchange = rd.exchange.to_text(omit_final_dot=True) or "."
            out.append(f"{rd.preference} {exchange}")
        else:
            out.append(rd.to_text())
    return out


def _first_response(e: dns.resolver.NXDOMAIN) -> dns.message.Message | None:
    responses: dict[object, dns.message.Message] = e.kwargs.get("responses") or {}
    return next(iter(responses.values()), None)


def _negative_ttl(response: dns.message.Message | None) -> float:
    """RFC 2308 §5: a negative answer is kept for min(SOA TTL, SOA MINIMUM) of the zone."""
    if response is None:
        return 0.0
    for rrset in response.authority:
        if rrset.rdtype == dns.rdatatype.SOA:
            return float(min(rrset.ttl, rrset[0].minimum))
    return 0.0


def _rcode_of(e: dns.resolver.NoNameservers) -> str:
    """ "SERVFAIL" (or the rcode every server gave), from dnspython's error list."""
    errors = e.kwargs.get("errors") or []
    for _server, _tcp, _port, _err, response in errors:
        if isinstance(response, dns.message.Message):
            return str(dns.rcode.to_text(response.rcode()))
    return "no nameserver answered"
