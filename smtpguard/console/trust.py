"""The console's reading of a request's Host and X-Forwarded-For (DESIGN.md §18): gathers
them from aiohttp's request and asks smtpguard/policy/http_trust.py."""

from __future__ import annotations

from aiohttp import web

from smtpguard.config import ConsoleConfig
from smtpguard.policy import http_trust


def client(request: web.Request, console: ConsoleConfig) -> str:
    """The client's address: X-Forwarded-For only when the peer is a trusted proxy."""
    peer = request.remote or "?"
    if not console.trusted_proxies:
        return http_trust.client_address(peer, (), ())
    return http_trust.client_address(peer, request.headers.getall("X-Forwarded-For", []), console.proxies)


def check_host(request: web.Request, console: ConsoleConfig) -> None:
    """400 for a request without one clear Host, 421 for a host this console is not."""
    try:
        host, port = http_trust.request_host(request.raw_path, request.headers.getall("Host", []))
    except ValueError as e:
        raise web.HTTPBadRequest(reason=str(e)) from None
    if not http_trust.host_allowed(host, port, allowed(console)):
        raise web.HTTPMisdirectedRequest(
            reason=f"this console does not answer for {host!r}{f' at port {port}' if port else ''}; "
            "an operator adds the names it is reached by to console.hosts"
        )


def allowed(console: ConsoleConfig) -> list[tuple[str, int | None]]:
    names = [http_trust.host_port(h) for h in console.hosts]
    listen = console.host
    if listen not in http_trust.WILDCARDS:
        names.append((http_trust.host_port(f"[{listen}]" if ":" in listen else listen)[0], None))
    return names
