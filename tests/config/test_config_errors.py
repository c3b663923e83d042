"""Config that cannot lie: every refusal names the YAML path and the line at fault.

Each test writes a real file and runs `smtpguard check-config` in-process, as an operator
would; the expected line numbers are found in the file's text, not hard-coded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from smtpguard.cli import main
from smtpguard.config import ConfigError, loads
from tests.support import base_config, write_config


def line_of(text: str, needle: str, nth: int = 1) -> int:
    seen = 0
    for i, line in enumerate(text.splitlines(), start=1):
        if needle in line:
            seen += 1
            if seen == nth:
                return i
    raise AssertionError(f"{needle!r} not in the file")


def check(tmp: Path, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    path = tmp / "c.yaml"
    path.write_text(text)
    assert main(["check-config", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def base_text(tmp: Path) -> str:
    return write_config(tmp / "base.yaml", base_config(tmp, 2525)).read_text()


def test_a_duplicate_zone_is_refused_with_both_lines(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = base_text(tmp)
    # A second `acme:` at the end of zones: PyYAML alone would keep it and drop the first's users.
    text += "  acme:\n    plan: free\n"
    err = check(tmp, text, capsys)
    first, second = line_of(text, "  acme:"), line_of(text, "  acme:", 2)
    assert f"zones.acme (lines {first} and {second}): duplicate key" in err
    with pytest.raises(ConfigError):
        loads(text)


def test_a_duplicate_key_inside_a_list_item_names_its_path(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = base_text(tmp).replace("  pool_size: 8\n", "  pool_size: 8\n  pool_size: 2\n")
    err = check(tmp, text, capsys)
    a, b = line_of(text, "pool_size"), line_of(text, "pool_size", 2)
    assert f"providers[0].pool_size (lines {a} and {b}): duplicate key" in err


def test_yaml_merge_keys_are_not_duplicates(tmp: Path) -> None:
    text = base_text(tmp)
    assert "  globex:\n    plan: solo\n" in text
    # An explicit key beside a merged one overrides it: that is what `<<` is for.
    text = text.replace(
        "  globex:\n    plan: solo\n", "  globex:\n    <<: {plan: agency}\n    plan: starter\n"
    )
    assert loads(text).zones["globex"].plan == "starter"


@pytest.mark.parametrize(
    ("replace", "with_", "field", "needle", "expect"),
    [
        (
            "    plan: business\n",
            "    plan: business\n    hourly_cap: '20'\n",
            "zones.acme.hourly_cap",
            "hourly_cap",
            "expected a whole number, got '20' (a quoted string: write it without quotes)",
        ),
        (
            "    plan: business\n",
            "    plan: business\n    paused: 'on'\n",
            "zones.acme.paused",
            "paused",
            "expected true or false, got 'on'",
        ),
        (
            "    plan: business\n",
            "    plan: business\n    paused: on\n",
            "zones.acme.paused",
            "paused",
            "expected true or false, got 'on' (yes/no/on/off are strings here: write true or false)",
        ),
        (
            "  pool_size: 8\n",
            "  pool_size: '8'\n",
            "providers[0].pool_size",
            "pool_size",
            "expected a whole number",
        ),
        (
            "    plan: business\n",
            "    plan: business\n    hourly_cpa: 5\n",
            "zones.acme.hourly_cpa",
            "hourly_cpa",
            "unknown key; did you mean `hourly_cap`?",
        ),
        (
            "  pool_size: 8\n",
            "  pool_size: 8\n  pool_sise: 8\n",
            "providers[0].pool_sise",
            "pool_sise",
            "unknown key; did you mean `pool_size`?",
        ),
        (
            "    plan: business\n",
            "    plan: gold\n",
            "zones.acme.plan",
            "plan: gold",
            "'gold' is not one of: free, solo, starter, business, agency, unlimited",
        ),
        (
            "    plan: business\n",
            "    plan: business\n    recipient_domains: on\n",
            "zones.acme.recipient_domains",
            "recipient_domains",
            "recipient_domains is 'on': write check or off",
        ),
        (
            "    plan: business\n",
            "    plan: business\n    recipient_domains: true\n",
            "zones.acme.recipient_domains",
            "recipient_domains",
            "recipient_domains is true: write check (or off)",
        ),
        (
            "  pool_size: 8\n",
            "  pool_size: 8\n  dkim_selectors: [pic._domainkey]\n",
            "providers[0].dkim_selectors",
            "dkim_selectors",
            "dkim selector 'pic._domainkey' includes ._domainkey: give the selector alone ('pic')",
        ),
        (
            "  pool_size: 8\n",
            "  pool_size: 8\n  probe_interval: 5s\n",
            "providers[0].probe_interval",
            "probe_interval",
            "must be at least 10.0, got '5s'",
        ),
    ],
)
def test_strict_types_and_suggestions(
    tmp: Path,
    capsys: pytest.CaptureFixture[str],
    replace: str,
    with_: str,
    field: str,
    needle: str,
    expect: str,
) -> None:
    text = base_text(tmp)
    assert replace in text
    text = text.replace(replace, with_, 1)
    err = check(tmp, text, capsys)
    assert f"{field} (line {line_of(text, needle)}): {expect}" in err, err


def test_a_missing_kind_names_the_kinds(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = base_text(tmp).replace("  kind: smtp\n", "", 1)
    err = check(tmp, text, capsys)
    assert "providers[0] (line " in err
    assert "`kind` is missing; say which kind this is: one of smtp, maildir" in err
    assert "discriminator" not in err and "tag" not in err


def test_an_unknown_kind_is_reported_at_its_line(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = base_text(tmp).replace("kind: smtp", "kind: ses", 1)
    err = check(tmp, text, capsys)
    assert f"providers[0] (line {line_of(text, 'kind: ses')}): kind 'ses' is not a known kind" in err
    assert "smtp, maildir" in err


def test_a_zone_named_like_a_provider_kind_keeps_its_name(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, 2525)
    cfg["zones"]["smtp"] = cfg["zones"].pop("acme")
    cfg["zones"]["maildir"] = cfg["zones"].pop("globex")
    cfg["zones"]["smtp"]["plan"] = "gold"
    cfg["zones"]["maildir"]["hourly_cap"] = "x"
    text = write_config(tmp / "z.yaml", cfg).read_text()
    err = check(tmp, text, capsys)
    assert f"zones.smtp.plan (line {line_of(text, 'plan: gold')})" in err
    assert f"zones.maildir.hourly_cap (line {line_of(text, 'hourly_cap')})" in err


def test_a_missing_field_inside_a_provider_drops_only_the_tag(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = base_text(tmp).replace("  host: 127.0.0.1\n", "", 1)
    err = check(tmp, text, capsys)
    assert "providers[0].host (line " in err and "required key is missing" in err


@pytest.mark.parametrize(
    ("mutate", "path", "needle"),
    [
        # A listener asking for TLS with no tls section: at the listener's tls line.
        (lambda c: c["listen"][0].update(tls="starttls"), "listen[0].tls", "tls: starttls"),
        # Two users of one name in two zones: at the second one's username.
        (
            lambda c: c["zones"]["globex"]["users"][0].update(username="acme-app"),
            "zones.globex.users[0].username",
            "username: acme-app#2",
        ),
        # A second provider of the same name: at its name.
        (
            lambda c: c["providers"].append({"name": "primary", "kind": "maildir", "path": "x"}),
            "providers[1].name",
            "name: primary#2",
        ),
        (lambda c: c["zones"]["acme"].update(default_class="nope"), "zones.acme.default_class", "nope"),
        (lambda c: c["providers"][0].update(username="u"), "providers[0].username", "username: u"),
        (lambda c: c["listen"][0].update(address="0.0.0.0:2587"), "listen[0].tls", "tls: none"),
        (lambda c: c["zones"].update({"Bad Zone": {"plan": "solo"}}), "zones.Bad Zone", "Bad Zone"),
        (
            lambda c: c.update(queue={"default_class": "later"}),
            "queue.default_class",
            "default_class: later",
        ),
    ],
)
def test_cross_field_errors_name_the_fields_line(
    tmp: Path, capsys: pytest.CaptureFixture[str], mutate: object, path: str, needle: str
) -> None:
    cfg = base_config(tmp, 2525)
    mutate(cfg)  # type: ignore[operator]
    text = write_config(tmp / "x.yaml", cfg).read_text()
    err = check(tmp, text, capsys)
    needle, _, nth = needle.partition("#")
    line = line_of(text, needle, int(nth or 1))
    assert line > 1
    assert f"{path} (line {line}):" in err, err


def test_the_shipped_config_and_the_documented_example_still_load() -> None:
    root = Path(__file__).resolve().parents[2]
    loads((root / "conf" / "smtpguard.yaml").read_text())


def test_a_duplicate_key_inside_a_merge_value_is_refused(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = base_text(tmp).replace(
        "    plan: business\n",
        "    <<: {plan: business, hourly_cap: 5,\n      hourly_cap: 50}\n",
    )
    err = check(tmp, text, capsys)
    a, b = line_of(text, "hourly_cap: 5"), line_of(text, "hourly_cap: 50}")
    assert f"zones.acme.hourly_cap (lines {a} and {b}): duplicate key" in err
    # An anchor merged through an alias is checked where the anchor is.
    text = base_text(tmp).replace(
        "    plan: business\n", "    plan: business\n    x-defaults: &d {hourly_cap: 5, hourly_cap: 6}\n"
    )
    assert "zones.acme.x-defaults.hourly_cap" in check(tmp, text, capsys)


def test_an_error_on_a_key_overriding_a_merged_one_names_its_own_line(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = base_text(tmp).replace(
        "  globex:\n    plan: solo\n", "  globex:\n    <<: {plan: solo}\n    plan: gold\n"
    )
    err = check(tmp, text, capsys)
    assert f"zones.globex.plan (line {line_of(text, 'plan: gold')})" in err


@pytest.mark.parametrize("depth", [998, 1500])
def test_deeply_nested_yaml_is_one_line_not_a_traceback(
    tmp: Path, capsys: pytest.CaptureFixture[str], depth: int
) -> None:
    text = base_text(tmp) + "x-deep: " + "[" * depth + "]" * depth + "\n"
    err = check(tmp, text, capsys)
    assert len(err.strip().splitlines()) == 1, err
    assert "nested too deeply" in err or "nesting depth" in err
    with pytest.raises(ConfigError):
        loads(text)


def test_errors_speak_plainly_hide_secrets_and_cut_long_values(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, 2525)
    cfg["tls"] = {"cert": 5, "key": str(tmp / "key.pem")}
    cfg["zones"]["acme"]["users"][0]["password_hash"] = 123456
    cfg["zones"]["acme"]["plan"] = "x" * 300
    cfg["zones"]["acme"]["missing_key"] = "rejectt"
    text = write_config(tmp / "c.yaml", cfg).read_text()
    err = check(tmp, text, capsys)
    assert "tls.cert" in err and "expected a file path, got 5" in err
    assert "instance of" not in err
    assert "password_hash" in err and "123456" not in err
    assert "x" * 80 not in err and "…" in err
    assert "'rejectt' is not one of" in err


def test_probe_waits_are_jittered_within_ten_percent() -> None:
    import random

    from smtpguard.readiness.prober import jittered

    rng = random.Random(14)
    waits = [jittered(300.0, rng) for _ in range(200)]
    assert all(270.0 <= w <= 330.0 for w in waits)
    assert len({round(w) for w in waits}) > 20  # not one fixed offset shared by every instance


@pytest.mark.parametrize(
    ("mailbox", "path", "problem"),
    [
        ({"domain": "verp.guard.example"}, "events.mailbox.domain", "domain needs secret_env or secret_file"),
        (
            {"domain": "not a domain", "secret_env": "S"},
            "events.mailbox.domain",
            "VERP domain 'not a domain' is not a DNS name",
        ),
        (
            # 4 labels of 60: a DNS name, but b+TOKEN@ it is past RFC 5321's 256-octet path.
            {"domain": ".".join(["a" * 60] * 4 + ["example"]), "secret_env": "S"},
            "events.mailbox.domain",
            "longer than 206 characters",
        ),
        (
            {"domain": "verp.guard.example", "secret_env": "S", "secret_file": "/etc/hostname"},
            "events.mailbox.secret_file",
            "give secret_env or secret_file, not both",
        ),
    ],
)
def test_a_bad_verp_setting_names_its_path_and_line(
    mailbox: dict[str, str], path: str, problem: str, tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    box = {"listen": "127.0.0.1:2526", "address": "bounces@guard.test", "provider": "primary", **mailbox}
    text = write_config(tmp / "v.yaml", base_config(tmp, 2525, events={"mailbox": box})).read_text()
    err = check(tmp, text, capsys)
    field = path.rsplit(".", 1)[1]
    assert f"{path} (line {line_of(text, f'{field}:')}): " in err and problem in err, err


@pytest.mark.parametrize(
    ("url", "size", "expected"),
    [
        ("postgresql://sg@db1,db2/sg?target_session_attrs=read-write", "0", "must be at least 1, got 0"),
        ("postgresql://sg@db1/sg", "1001", "1000"),
        ("sqlite:///state.db", "8", "store.pool_size is for PostgreSQL"),
    ],
)
def test_store_pool_size_is_validated_naming_its_line(
    tmp: Path, capsys: pytest.CaptureFixture[str], url: str, size: str, expected: str
) -> None:
    cfg = base_config(tmp, 2525)
    cfg["store"] = {"url": url, "pool_size": 1}
    text = write_config(tmp / "p.yaml", cfg).read_text().replace("pool_size: 1", f"pool_size: {size}")
    err = check(tmp, text, capsys)
    assert f"store.pool_size (line {line_of(text, f'pool_size: {size}')})" in err, err
    assert expected in err, err


def test_store_pool_size_sizes_the_postgresql_pool(tmp: Path) -> None:
    from smtpguard.store import store_from_url

    cfg = base_config(tmp, 2525)
    cfg["store"] = {"url": "postgresql://sg@db1/sg", "pool_size": 5}
    config = loads(write_config(tmp / "p.yaml", cfg).read_text())
    assert config.store.pool_size == 5
    store = store_from_url(config.store.url, pool_size=config.store.pool_size)
    assert store._pool_size == 5  # type: ignore[attr-defined]


def test_a_verp_domain_under_an_internationalised_tld_is_a_dns_name(tmp: Path) -> None:
    box = {"listen": "127.0.0.1:2526", "address": "bounces@guard.test", "provider": "primary"}
    box |= {"domain": "verp.example.xn--p1ai", "secret_env": "S"}
    cfg = loads(yaml.safe_dump(base_config(tmp, 2525, events={"mailbox": box})))
    assert cfg.events is not None and cfg.events.mailbox is not None
    assert cfg.events.mailbox.domain == "verp.example.xn--p1ai"


@pytest.mark.parametrize(
    ("secret", "problem"),
    [
        (None, "events.mailbox: environment variable SMTPGUARD_T_VERP is not set"),
        ("", "events.mailbox: the VERP secret is empty"),
        # Four letters: anyone holding one token (every recipient does) can find it offline.
        ("abcd", "events.mailbox: the VERP secret is 4 bytes; it needs at least 16"),
    ],
)
def test_check_config_reads_the_verp_secret_as_serve_does(
    secret: str | None,
    problem: str,
    tmp: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # check-config said "config OK" for a VERP secret that serve then refused to start with.
    monkeypatch.delenv("SMTPGUARD_T_VERP", raising=False)
    if secret is not None:
        monkeypatch.setenv("SMTPGUARD_T_VERP", secret)
    box = {"listen": "127.0.0.1:2526", "address": "bounces@guard.test", "provider": "primary"}
    box |= {"domain": "verp.guard.example", "secret_env": "SMTPGUARD_T_VERP"}
    err = check(
        tmp, write_config(tmp / "v.yaml", base_config(tmp, 2525, events={"mailbox": box})).read_text(), capsys
    )
    assert problem in err, err


@pytest.mark.parametrize(
    "url",
    [
        # The hosts given as a query parameter, not in the authority.
        "postgresql://sg@/sg?host=db1,db2",
        # A second target_session_attrs: libpq takes the last one.
        "postgresql://sg@db1,db2/sg?target_session_attrs=read-write&target_session_attrs=any",
        "postgresql://sg@/sg?host=db1,db2&target_session_attrs=primary&target_session_attrs=prefer-standby",
    ],
)
def test_a_multi_host_url_that_libpq_may_connect_to_a_standby_is_refused(
    tmp: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    cfg = base_config(tmp, 2525)
    cfg["store"] = {"url": url}
    text = write_config(tmp / "h.yaml", cfg).read_text()
    err = check(tmp, text, capsys)
    assert f"store.url (line {line_of(text, 'url: postgresql')})" in err, err
    assert "needs target_session_attrs=read-write" in err, err


def test_a_multi_host_url_with_read_write_last_is_accepted(tmp: Path) -> None:
    cfg = base_config(tmp, 2525)
    url = "postgresql://sg@/sg?target_session_attrs=any&host=db1,db2&target_session_attrs=read-write"
    cfg["store"] = {"url": url}
    assert loads(write_config(tmp / "h.yaml", cfg).read_text()).store.url == url


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"url": "postgresql://app:hunter2@db/shop"}, "outbox.shop.url (line"),
        ({"url": "mysql://app@db/shop"}, "outbox.shop.url (line"),
        ({"table": "Shop-Mail"}, "outbox.shop.table (line"),
        ({"table": "x; drop table y"}, "outbox.shop.table (line"),
        # Its index and trigger names (+ _due, _notify) would pass PostgreSQL's 63.
        ({"table": "t" * 57}, "outbox.shop.table (line"),
        ({"zone": "nope"}, "outbox.shop.zone (line"),
        ({"user": "globex-app"}, "outbox.shop.user (line"),
        ({"poll": "0s"}, "outbox.shop.poll (line"),
        ({"batch": 0}, "outbox.shop.batch (line"),
        ({"typo": 1}, "outbox.shop.typo (line"),
    ],
)
def test_outbox_errors_name_the_field_and_its_line(
    source: dict[str, object], expected: str, tmp: Path
) -> None:
    cfg = base_config(tmp, 2525)
    cfg["outbox"] = {
        "shop": {"url": "postgresql://app@db/shop", "zone": "acme", "user": "acme-app", **source}
    }
    with pytest.raises(ConfigError) as e:
        loads(yaml.safe_dump(cfg, sort_keys=False))
    text = str(e.value)
    assert expected in text, text
    assert "hunter2" not in text
