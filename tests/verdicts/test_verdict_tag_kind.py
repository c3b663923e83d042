"""A provider's log `api` must be searchable by the tag the relay writes (DESIGN.md §19). The
relay writes the tag of the first events source reading the provider's webhooks; a SendGrid or
Postmark api under a source of another kind searched for a tag no message carried, found
every accepted message absent, and with a later acceptance as the proof judged it `not
accepted`: sent again. Such a config is now refused naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from smtpguard.config import ConfigError, loads
from smtpguard.policy.tags import tagged
from smtpguard.server.reload import _event_tags
from tests.support import Received, base_config
from tests.support.verdicts import api_section, tag_of


def config(tmp: Path, api_kind: str, source_kind: str) -> dict[str, Any]:
    cfg = base_config(tmp, 2525)
    cfg["providers"][0]["api"] = api_section(api_kind, "http://127.0.0.1:1")
    secret = tmp / "hook.secret"
    secret.write_text("whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" + "\n")
    source: dict[str, Any] = {"kind": source_kind, "provider": cfg["providers"][0]["name"]}
    source.update(
        {
            "svix": {"secret_file": str(secret)},
            "mailgun": {"signing_key_file": str(secret)},
            "postmark": {"username": "hooks", "password_file": str(secret)},
        }[source_kind]
    )
    cfg["events"] = {"address": "127.0.0.1:0", "sources": {"hooks": source}}
    return cfg


@pytest.mark.parametrize(("api_kind", "source_kind"), [("sendgrid", "svix"), ("postmark", "mailgun")])
def test_an_api_whose_tag_the_relay_does_not_write_is_refused(
    tmp: Path, api_kind: str, source_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTPGUARD_TEST_LOG_API_KEY", "k")
    cfg = config(tmp, api_kind, source_kind)
    with pytest.raises(ConfigError, match=r"providers\[0\]\.api\.kind \(line \d+\): .*cannot be searched by"):
        loads(yaml.safe_dump(cfg))
    # What the relay would write under it: no tag the api's log is searched by.
    del cfg["providers"][0]["api"]
    written = _event_tags(loads(yaml.safe_dump(cfg)))[cfg["providers"][0]["name"]]
    content = tagged(written, "acme:1", "sg1", b"Subject: x\r\n\r\nbody\r\n")
    assert tag_of(Received("a@x", ["b@y"], content), api_kind) is None


@pytest.mark.parametrize(("api_kind", "source_kind"), [("postmark", "postmark"), ("mailgun", "svix")])
def test_an_api_searchable_by_what_the_relay_writes_loads(
    tmp: Path, api_kind: str, source_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTPGUARD_TEST_LOG_API_KEY", "k")
    # Mailgun's log is searched by the Message-ID: it needs no tag of its own.
    loads(yaml.safe_dump(config(tmp, api_kind, source_kind)))
