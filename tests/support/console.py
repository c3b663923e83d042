"""A guard with its console, held events made the real way (an upstream that drops the
connection after the final dot leaves `unknown`; one that answers 5xx leaves `failed`),
and an HTTP client that logs in as a browser does (cookie, CSRF token from the form)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from smtpguard.server import Server
from tests.support import Behaviour, Upstream, base_config, message, password_hash, send

PASSWORDS = {"alice": "alice-pass-1", "bob": "bob-pass-2", "victor": "victor-pass-3"}
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def console_config(tmp: Path, upstream: Upstream, **overrides: Any) -> dict[str, Any]:
    operators = [
        {"username": "alice", "password_hash": password_hash(PASSWORDS["alice"]), "role": "operator"},
        {"username": "bob", "password_hash": password_hash(PASSWORDS["bob"]), "role": "operator"},
        {"username": "victor", "password_hash": password_hash(PASSWORDS["victor"]), "role": "viewer"},
    ]
    console = {"address": "127.0.0.1:0", "operators": operators}
    return base_config(tmp, upstream.port, console=console, **overrides)


def console_port(guard: Server) -> int:
    assert guard.console is not None
    return guard.console.port


async def hold(guard: Server, upstream: Upstream, key: str, state: str = "unknown") -> None:
    """A held record, by the upstream's own doing."""
    upstream.handler.script.append(
        Behaviour(drop_after_dot=True)
        if state == "unknown"
        else Behaviour(data="554 5.7.1 refused by policy")
    )
    reply = await send(guard.ports[0], message(key))
    assert reply.code == (451 if state == "unknown" else 554), reply
    assert guard.store is not None
    rec = await guard.store.get("acme", key)
    assert rec is not None and rec.state.value == state


@dataclass
class Page:
    status: int
    text: str
    url: str

    @property
    def csrf(self) -> str:
        m = _CSRF.search(self.text)
        assert m, "no CSRF token on the page"
        return m.group(1)


class Operator:
    """One browser-like HTTP client: its own cookie jar, from `source` (any 127.0.0.N is a
    client of its own), sending `headers` (X-Forwarded-For, say) with every request."""

    def __init__(self, port: int, source: str | None = None, headers: dict[str, str] | None = None) -> None:
        self.base = f"http://127.0.0.1:{port}"
        connector = aiohttp.TCPConnector(local_addr=(source, 0)) if source else None
        self.session = aiohttp.ClientSession(
            cookie_jar=aiohttp.CookieJar(unsafe=True), connector=connector, headers=headers
        )
        self.csrf = ""

    async def close(self) -> None:
        await self.session.close()

    async def get(self, path: str) -> Page:
        async with self.session.get(self.base + path) as r:
            return Page(r.status, await r.text(), str(r.url))

    async def post(self, path: str, data: dict[str, str], csrf: bool = True) -> Page:
        form = {**data, **({"csrf": self.csrf} if csrf else {})}
        async with self.session.post(self.base + path, data=form) as r:
            return Page(r.status, await r.text(), str(r.url))

    async def login(self, username: str, password: str | None = None) -> Page:
        page = await self.get("/login")
        self.csrf = page.csrf
        result = await self.post(
            "/login", {"username": username, "password": password or PASSWORDS[username]}
        )
        if result.status == 200 and "/login" not in result.url:
            self.csrf = result.csrf
        return result
