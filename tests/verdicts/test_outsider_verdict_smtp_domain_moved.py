"""A Mailgun provider whose SMTP login (postmaster@DOMAIN: Mailgun's SMTP credentials are a
domain's) is moved by a reload to another domain while its `api.domain` still names the old
one. The message goes to the new domain, whose log the api never reads. Before, its note
named the api's log, the old domain's own traffic was the proof of ingestion, and `not
accepted` let the retry send a second copy. Now a provider whose SMTP login is of another
domain than its api notes no log: nothing is proved absent, and the retry is held."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from smtpguard.config import loads
from smtpguard.policy.ledger import State
from smtpguard.server.reload import _logs
from tests.support import FakeClock, Upstream, message, running_guard, send, write_config
from tests.support.provider_api_fakes import FakeMailgun
from tests.support.verdicts import API_ENV, API_KEY, MAILGUN_DOMAIN, verdict_config
from tests.verdicts.test_verdict_loop import MINUTE, Harness

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


async def test_an_smtp_login_moved_to_another_domain_never_proves_absence_in_the_api_domain(
    tmp: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    monkeypatch.setattr("tests.support.UPSTREAM_USER", f"postmaster@{MAILGUN_DOMAIN}")
    clock = FakeClock()
    upstream = Upstream(password="mg-smtp-secret")
    old_log = FakeMailgun(API_KEY, MAILGUN_DOMAIN, clock)
    await upstream.start()
    await old_log.start()
    secret = tmp / "smtp.pass"
    secret.write_text("mg-smtp-secret\n")
    try:
        cfg = verdict_config(tmp, upstream.port, store_url, "mailgun", old_log.base_url)
        cfg["providers"][0].update({"username": f"postmaster@{MAILGUN_DOMAIN}", "password_file": str(secret)})
        path = tmp / "c.yaml"
        async with running_guard(cfg, clock=clock, config_path=path) as guard:
            h = Harness(guard, clock, old_log, upstream, "mailgun")
            # The SMTP side moves to mg2's credentials; the api is left naming mg.
            monkeypatch.setattr("tests.support.UPSTREAM_USER", "postmaster@mg2.acme.example")
            upstream.rotate("mg2-smtp-secret")
            secret.write_text("mg2-smtp-secret\n")
            cfg["providers"][0]["username"] = "postmaster@mg2.acme.example"
            write_config(path, cfg)
            assert await guard.reload()
            rec = await h.lose_reply("m1")
            h.other_acceptance(rec.attempts[-1].at + 30)  # mg's own traffic
            for _ in range(12):
                await h.after(5 * MINUTE)
            retry = await send(guard.ports[0], message("m1"))
            assert (retry.code, upstream.event_keys()) == (451, ["m1"]), "the retry sent a second copy"
            await h.record("m1", State.UNKNOWN)
    finally:
        await old_log.stop()
        await upstream.stop()


@pytest.mark.parametrize(
    ("username", "noted"),
    [
        (f"postmaster@{MAILGUN_DOMAIN}", True),
        (f"Postmaster@{MAILGUN_DOMAIN.upper()}.", True),
        ("relay-user", True),  # a login that names no domain: nothing to compare
        ("postmaster@mg2.acme.example", False),
    ],
)
def test_a_mailgun_login_of_another_domain_than_the_api_notes_no_log(
    tmp: Path, store_url: str, monkeypatch: pytest.MonkeyPatch, username: str, noted: bool
) -> None:
    monkeypatch.setenv(API_ENV, API_KEY)
    secret = tmp / "smtp.pass"
    secret.write_text("s\n")
    cfg = verdict_config(tmp, 2525, store_url, "mailgun", "http://127.0.0.1:1")
    cfg["providers"][0].update({"username": username, "password_file": str(secret)})
    config = loads(yaml.safe_dump(cfg))
    assert (config.providers[0].name in _logs(config)) is noted
