"""Every route the console declares (read from its own route table, so a route added later is
attacked too), by a stranger, by a logged-in browser whose form lacks or forges the CSRF
token, by a viewer, and through a foreign Host: no page without a session, no change
without the session's token and the operator role, nothing for another Host. Afterwards
nothing changed: the zone sends (counted at the upstream), its suppression list is
empty, the held record is still `unknown`."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from smtpguard.console.app import _PAGES
from tests.support import Upstream, message, running_guard, send
from tests.support.console import Operator, console_config, hold

pytestmark = pytest.mark.usefixtures("no_tracebacks")

_PARAM = re.compile(r"\{(\w+)(?::([^}]+))?\}")
_VALUES = {"zone": "acme", "key": "held:1"}


def _concrete(path: str) -> str:
    """The route's path with its parameters filled in (an alternation: its first word)."""
    return _PARAM.sub(lambda m: _VALUES.get(m.group(1)) or (m.group(2) or "x").split("|")[0], path)


def _forms(path: str) -> dict[str, str]:
    return {
        "/decide": {"zone": "acme", "key": "held:1", "action": "delivered", "version": "1"},
        "/suppression/acme/add": {"address": "someone@example.com"},
    }.get(path, {})


ROUTES = [(method, _concrete(path)) for method, path, _ in _PAGES]


async def test_every_route_refuses_strangers_forged_tokens_viewers_and_foreign_hosts(
    tmp: Path, upstream: Upstream
) -> None:
    assert ("POST", "/decide") in ROUTES and ("GET", "/") in ROUTES  # the table was read
    async with running_guard(console_config(tmp, upstream)) as guard:
        await hold(guard, upstream, "held:1")
        assert guard.console is not None
        base = f"http://127.0.0.1:{guard.console.port}"
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as stranger:
            for method, path in ROUTES:
                async with stranger.request(
                    method, base + path, data=_forms(path), allow_redirects=False
                ) as r:
                    if path == "/login":
                        assert r.status in (200, 403), (method, path, r.status)  # 403: no login cookie
                    elif method == "GET":
                        assert (r.status, r.headers.get("Location")) == (303, "/login"), (path, r.status)
                    else:
                        assert r.status == 403, (path, r.status)
        alice, victor = Operator(guard.console.port), Operator(guard.console.port)
        try:
            assert (await alice.login("alice")).status == 200
            assert (await victor.login("victor")).status == 200
            posts = [p for m, p in ROUTES if m == "POST" and p not in ("/login", "/logout")]
            for path in posts:
                genuine = alice.csrf
                for token in (None, "", genuine[:-1], genuine + "x", victor.csrf):
                    form = {**_forms(path), **({"csrf": token} if token is not None else {})}
                    page = await alice.post(path, form, csrf=False)
                    assert page.status == 403, (path, token, page.status)
                page = await victor.post(path, _forms(path))
                assert page.status == 403, (path, "viewer", page.status)
                async with alice.session.post(
                    alice.base + path,
                    data={**_forms(path), "csrf": genuine},
                    headers={"Host": "attacker.example"},
                    allow_redirects=False,
                ) as r:
                    assert r.status == 421, (path, "foreign host", r.status)
            for method, path in ROUTES:
                if method == "GET" and "{" not in path:
                    async with alice.session.get(
                        alice.base + path, headers={"Host": "attacker.example:80"}, allow_redirects=False
                    ) as r:
                        assert r.status == 421, (path, r.status)
        finally:
            await alice.close()
            await victor.close()
        assert guard.store is not None
        assert await guard.store.suppress_list("acme") == []
        record = await guard.store.get("acme", "held:1")
        assert record is not None and record.state.value == "unknown"
        assert (await send(guard.ports[0], message("after:1"))).code == 250
    assert upstream.event_keys() == ["held:1", "after:1"]
