"""The outbox url as an operator might write it: a password spelled so that libpq reads it
(percent-encoded, as libpq decodes every query keyword) is still a password in a file that
operators share and keep in repositories, and refused as `user:secret@` and `password=` are."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict

from smtpguard.config import ConfigError, loads
from tests.support import base_config

SECRETS = [
    "postgresql://app@db/shop?pass%77ord=hunter2",
    "postgresql://app@db/shop?%70%61%73%73%77%6F%72%64=hunter2",
    "postgresql://app@db/shop?sslmode=require&pass%77ord=hunter2",
    # The passphrase of the client's TLS key: a secret as much as the password.
    "postgresql://app@db/shop?sslpassword=hunter2",
    "postgresql://app@db/shop?sslpass%77ord=hunter2",
]


@pytest.mark.parametrize("url", SECRETS)
def test_a_password_libpq_would_read_from_the_url_is_refused_without_echoing_it(url: str, tmp: Path) -> None:
    # libpq itself reads a secret out of each of these urls.
    assert "hunter2" in conninfo_to_dict(url).values()
    cfg = base_config(tmp, 2525)
    cfg["outbox"] = {"shop": {"url": url, "zone": "acme", "user": "acme-app"}}
    with pytest.raises(ConfigError) as e:
        loads(yaml.safe_dump(cfg, sort_keys=False))
    text = str(e.value)
    assert "outbox.shop.url (line" in text and "password_env" in text, text
    assert "hunter2" not in text


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app@db/shop?sslmode=verify-full&passfile=/etc/smtpguard/pgpass",
        "postgresql://app@db1,db2/shop?target_session_attrs=read-write",
        "postgresql://app%3Aname@db/shop",  # a colon in the user's name, no password
    ],
)
def test_a_url_without_a_secret_is_accepted(url: str, tmp: Path) -> None:
    assert "password" not in conninfo_to_dict(url)
    cfg = base_config(tmp, 2525)
    cfg["outbox"] = {"shop": {"url": url, "zone": "acme", "user": "acme-app"}}
    assert loads(yaml.safe_dump(cfg, sort_keys=False)).outbox["shop"].url == url
