"""CSRF tokens that are not what the console issues, from a stranger at the login form and
from a logged-in browser: a token or login cookie with non-ASCII characters is a wrong
token (403), never a 500 with a traceback in the log (compare_digest refuses such str),
and nothing changes. Counted at the upstream: the zone was not paused."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.support import Upstream, message, running_guard, send
from tests.support.console import Operator, console_config

pytestmark = pytest.mark.usefixtures("no_tracebacks")


@pytest.mark.parametrize(
    ("csrf", "cookie"),
    [("é", "abc"), ("abc", "é"), ("abc", "%C3%A9")],
)
async def test_a_login_with_a_non_ascii_token_or_cookie_is_403(
    tmp: Path, upstream: Upstream, csrf: str, cookie: str
) -> None:
    async with running_guard(console_config(tmp, upstream)) as guard:
        assert guard.console is not None
        async with (
            aiohttp.ClientSession() as browser,
            browser.post(
                f"http://127.0.0.1:{guard.console.port}/login",
                data={"csrf": csrf, "username": "alice", "password": "alice-pass-1"},
                headers={"Cookie": f"sg_login={cookie}"},
            ) as r,
        ):
            assert r.status == 403, await r.text()
            assert "sg_console" not in r.cookies


async def test_a_logged_in_post_with_a_non_ascii_csrf_token_is_403_and_changes_nothing(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(console_config(tmp, upstream)) as guard:
        assert guard.console is not None
        operator = Operator(guard.console.port)
        try:
            assert (await operator.login("alice")).status == 200
            genuine = operator.csrf
            for forged in ("é" + genuine[1:], genuine + "é", "\u0000é"):
                operator.csrf = forged
                page = await operator.post("/zones/acme/pause", {})
                assert page.status == 403, page.text[:300]
        finally:
            await operator.close()
        assert (await send(guard.ports[0], message("tokens:1"))).code == 250
    assert upstream.event_keys() == ["tokens:1"]
