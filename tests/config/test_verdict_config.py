"""`providers[].api`, `verdicts:` and `reconcile:` (DESIGN.md §19): accepted by check-config,
refused with the YAML path and line when wrong, never holding a key inline; and `serve`
runs the verdict loop and reconciliation they configure, saying so once."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from smtpguard.cli import main
from smtpguard.config import loads
from smtpguard.verdict_config import MailgunApi, PostmarkApi, SendgridApi
from tests.config.test_config_errors import line_of
from tests.support import Upstream, base_config, running_guard, write_config

SECRET = "key-9f2c1e0d7b6a5f4e3d2c1b0a"


def cfg_with(tmp: Path, api: dict[str, Any] | None, **top: Any) -> dict[str, Any]:
    cfg = base_config(tmp, 2525)
    if api is not None:
        cfg["providers"][0]["api"] = api
    cfg.update(top)
    return cfg


def run_check(tmp: Path, cfg: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    path = write_config(tmp / "c.yaml", cfg)
    rc = main(["check-config", "-c", str(path)])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, path.read_text(), out.err


def test_check_config_accepts_every_api_kind_and_the_sections(
    tmp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAILGUN_API_KEY", SECRET)
    key_file = tmp / "sg.key"
    key_file.write_text(SECRET + "\n")
    cfg = cfg_with(
        tmp,
        {"kind": "mailgun", "key_env": "MAILGUN_API_KEY", "domain": "mg.acme.example"},
        verdicts={"after": "2m", "every": "5m", "absent_after": "30m", "give_up": "24h"},
        reconcile={"events": "15m"},
    )
    standby = dict(cfg["providers"][0], name="standby")
    standby["api"] = {"kind": "postmark", "token_env": "POSTMARK_SERVER_TOKEN"}
    third = dict(cfg["providers"][0], name="third")
    third["api"] = {"kind": "sendgrid", "key_file": str(key_file), "base_url": "https://api.eu.sendgrid.com/"}
    cfg["providers"] += [standby, third]
    rc, _, err = run_check(tmp, cfg, capsys)
    assert rc == 0, err
    config = loads((tmp / "c.yaml").read_text())
    apis = [p.api for p in config.providers]  # type: ignore[union-attr]
    assert isinstance(apis[0], MailgunApi) and apis[0].url("mailgun") == "https://api.mailgun.net"
    assert isinstance(apis[1], PostmarkApi) and apis[1].url("postmark") == "https://api.postmarkapp.com"
    assert isinstance(apis[2], SendgridApi) and apis[2].url("sendgrid") == "https://api.eu.sendgrid.com"
    assert config.verdicts is not None
    assert (config.verdicts.after, config.verdicts.every) == (120.0, 300.0)
    assert (config.verdicts.absent_after, config.verdicts.give_up) == (1800.0, 86400.0)
    assert config.reconcile is not None and config.reconcile.events == 900.0


@pytest.mark.parametrize(
    ("api", "needle", "message"),
    [
        (
            {"kind": "mailgun", "key_env": "K", "domain": "mg.x", "kee_file": "/k"},
            "kee_file",
            "providers[0].api.kee_file (line {line}): unknown key",
        ),
        (
            {"kind": "mailgun", "key": SECRET, "domain": "mg.x"},
            f"key: {SECRET}",
            "providers[0].api.key (line {line}): unknown key",
        ),
        (
            {"kind": "mailgun", "key_env": "K"},
            "  api:",
            "providers[0].api.domain (line {line}): required key is missing",
        ),
        (
            {"kind": "postmark", "token_env": "T", "token_file": "/t"},
            "  api:",
            "providers[0].api (line {line}): give exactly one of token_env or token_file",
        ),
        (
            {"kind": "sendgrid"},
            "  api:",
            "providers[0].api (line {line}): give exactly one of key_env or key_file",
        ),
        (
            {"kind": "ses", "key_env": "K"},
            "kind: ses",
            "providers[0].api (line {line}): kind 'ses' is not a known kind; one of mailgun, "
            "postmark, sendgrid",
        ),
        (
            {"kind": "sendgrid", "key_env": "K", "base_url": "http://api.sendgrid.com"},
            "base_url",
            "providers[0].api.base_url (line {line}): base_url 'http://api.sendgrid.com' is plain http",
        ),
        (
            {"kind": "sendgrid", "key_env": "K", "base_url": "https://api.sendgrid.com/?k=1"},
            "base_url",
            "must not carry a query",
        ),
    ],
)
def test_a_bad_api_section_names_its_path_and_line(
    tmp: Path, capsys: pytest.CaptureFixture[str], api: dict[str, Any], needle: str, message: str
) -> None:
    rc, text, err = run_check(tmp, cfg_with(tmp, api), capsys)
    assert rc == 1
    assert message.format(line=line_of(text, needle)) in err, err
    assert SECRET not in err


@pytest.mark.parametrize(
    ("verdicts", "line_text", "message"),
    [
        ({"every": "5s"}, "  every: 5s", "verdicts.every (line {line}): must be at least 30"),
        (
            {"after": "40m"},
            "verdicts:",
            "verdicts (line {line}): absent_after (1800s) is before the first look",
        ),
        (
            {"absent_after": "2h", "give_up": "1h"},
            "verdicts:",
            "verdicts (line {line}): give_up (3600s) must be later than absent_after (7200s)",
        ),
        ({"give_up": "soon"}, "  give_up: soon", "verdicts.give_up (line {line}):"),
        ({"every": "5m", "retries": 3}, "  retries: 3", "verdicts.retries (line {line}): unknown key"),
    ],
)
def test_bad_verdict_timings_name_their_path_and_line(
    tmp: Path, capsys: pytest.CaptureFixture[str], verdicts: dict[str, Any], line_text: str, message: str
) -> None:
    cfg = cfg_with(tmp, {"kind": "postmark", "token_env": "T"}, verdicts=verdicts)
    rc, text, err = run_check(tmp, cfg, capsys)
    assert rc == 1
    assert message.format(line=line_of(text, line_text)) in err, err


def test_reconcile_without_any_api_is_refused(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, err = run_check(tmp, cfg_with(tmp, None, reconcile={"events": "15m"}), capsys)
    assert rc == 1
    assert f"reconcile (line {line_of(text, 'reconcile:')}): reconcile polls providers' APIs" in err


def test_reconcile_more_often_than_a_minute_is_refused(tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = cfg_with(tmp, {"kind": "postmark", "token_env": "T"}, reconcile={"events": "10s"})
    rc, text, err = run_check(tmp, cfg, capsys)
    assert rc == 1
    assert f"reconcile.events (line {line_of(text, 'events: 10s')}): must be at least 60" in err


async def test_serve_runs_the_verdict_loop_and_reconciliation_and_says_so_once(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSTMARK_SERVER_TOKEN", SECRET)
    cfg = base_config(tmp, upstream.port)
    cfg["providers"][0]["api"] = {"kind": "postmark", "token_env": "POSTMARK_SERVER_TOKEN"}
    cfg["verdicts"] = {"after": "1m"}
    cfg["reconcile"] = {"events": "15m"}
    caplog.set_level(logging.INFO)
    async with running_guard(cfg) as server:
        assert server.reconciler is not None and sorted(server.reconciler.apis) == ["primary"]
    assert not any("not yet applied" in r.getMessage() for r in caplog.records)
    # the verdict loop itself runs (tests/verdicts/test_verdict_loop.py), reconciliation too
    # (tests/events/test_reconcile.py)
    assert [r.apis for r in caplog.records if r.getMessage() == "verdict loop started"] == [["primary"]]  # type: ignore[attr-defined]
    assert [r.apis for r in caplog.records if r.getMessage() == "reconciliation started"] == [["primary"]]  # type: ignore[attr-defined]
    assert all(SECRET not in r.getMessage() and SECRET not in str(r.__dict__) for r in caplog.records)


async def test_serve_without_verdicts_says_nothing_of_them(
    tmp: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with running_guard(base_config(tmp, upstream.port)):
        pass
    assert any(r.getMessage() == "smtpguard started" for r in caplog.records)
    assert not any("verdicts" in r.getMessage() for r in caplog.records)
