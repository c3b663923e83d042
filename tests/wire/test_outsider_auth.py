"""AUTH PLAIN's authorization identity (RFC 4616 §2: `authzid NUL authcid NUL password`).
smtpguard has no proxy authorization: no user may act as another, so a message whose
authzid names anyone but the authenticating user fails as a bad password would, and
never opens a session as either user."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.support import OTHER_PASSWORD, PASSWORD, Upstream, base_config, running_guard
from tests.support.hostile import message_bytes, session, terminated

pytestmark = pytest.mark.usefixtures("no_tracebacks")


def _plain(authzid: str, authcid: str, password: str) -> str:
    return "AUTH PLAIN " + base64.b64encode(f"{authzid}\0{authcid}\0{password}".encode()).decode()


@pytest.mark.parametrize(
    ("authzid", "authcid", "password", "sender"),
    [
        pytest.param("globex-app", "acme-app", PASSWORD, "info@globex.example", id="acme-acting-as-globex"),
        pytest.param(
            "acme-app", "globex-app", OTHER_PASSWORD, "billing@acme.example", id="globex-acting-as-acme"
        ),
        pytest.param("nobody", "acme-app", PASSWORD, "billing@acme.example", id="unknown-authzid"),
    ],
)
async def test_an_authzid_naming_another_user_is_refused(
    tmp: Path, upstream: Upstream, authzid: str, authcid: str, password: str, sender: str
) -> None:
    async with (
        running_guard(base_config(tmp, upstream.port)) as guard,
        session(guard.ports[0], login=False) as c,
    ):
        auth = await c.command(_plain(authzid, authcid, password))
        mail = await c.command(f"MAIL FROM:<{sender}>")
    assert (auth.code, auth.enhanced) == (535, "5.7.8"), auth
    assert (mail.code, mail.enhanced) == (530, "5.7.0"), mail
    assert upstream.handler.transactions == 0


@pytest.mark.parametrize("authzid", ["", "acme-app"], ids=["empty", "itself"])
async def test_an_authzid_that_is_the_user_itself_is_accepted(
    tmp: Path, upstream: Upstream, authzid: str
) -> None:
    async with (
        running_guard(base_config(tmp, upstream.port)) as guard,
        session(guard.ports[0], login=False) as c,
    ):
        auth = await c.command(_plain(authzid, "acme-app", PASSWORD))
        assert (await c.command("MAIL FROM:<billing@acme.example>")).code == 250
        assert (await c.command("RCPT TO:<customer@example.com>")).code == 250
        sent = await c.data(terminated(message_bytes("authz:1")))
    assert auth.code == 235, auth
    assert sent.code == 250, sent
    assert len(upstream.received) == 1
