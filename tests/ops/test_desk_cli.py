"""The operator's desk in the CLI (DESIGN.md §14): list, history by id, one decision path
shared with the console, and every CLI change audited as cli:USER@HOST."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from smtpguard.cli import main
from tests.support import Upstream, base_config, message, running_guard, send, write_config
from tests.support.cli import cli
from tests.support.console import hold
from tests.support.utf8 import store_overrides


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp: Path) -> Any:
    yield from store_overrides(request, tmp, redis_db=10)


async def test_list_by_state_newest_first_and_history_by_every_id(
    tmp: Path, upstream: Upstream, store: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, upstream.port, **store)
    path = write_config(tmp / "c.yaml", cfg)
    c = str(path)
    async with running_guard(cfg) as guard:
        for i in range(3):
            assert (await send(guard.ports[0], message(f"ok:{i}"))).code == 250
        await hold(guard, upstream, "held:1")
        await hold(guard, upstream, "held:2", state="failed")
        code, doc = await cli(
            capsys, "list", "acme", "--state", "unknown", "--state", "failed", "--json", "-c", c
        )
        assert code == 0 and [(r["key"], r["state"]) for r in doc["records"]] == [
            ("held:2", "failed"),
            ("held:1", "unknown"),
        ]
        code, doc = await cli(capsys, "-c", c, "list", "--json", "--limit", "2")
        assert [r["key"] for r in doc["records"]] == ["held:2", "held:1"]
        code, doc = await cli(capsys, "list", "--json", "--since", "1h", "--provider", "primary", "-c", c)
        assert len(doc["records"]) == 5 and doc["records"][-1]["key"] == "ok:0"
        assert (await cli(capsys, "list", "--json", "--provider", "standby", "-c", c))[1]["records"] == []
        assert guard.store is not None
        rec = await guard.store.get("acme", "ok:1")
        assert rec is not None and rec.upstream_id and rec.message_id
        for flag, value in (
            ("--id", rec.sg_id),
            ("--message-id", rec.message_id),
            ("--upstream-id", rec.upstream_id),
        ):
            code, doc = await cli(capsys, "history", flag, value, "--json", "-c", c)
            assert (code, doc["key"]) == (0, "ok:1"), flag
        assert (await cli(capsys, "history", "--id", "nope", "-c", c))[0] == 3
        assert (await cli(capsys, "history", "acme", "-c", c))[0] == 2
        assert (await cli(capsys, "list", "--since", "soon", "-c", c))[0] == 2


async def test_cli_decisions_share_the_consoles_rule_and_everything_is_audited(
    tmp: Path, upstream: Upstream, store: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(tmp, upstream.port, **store)
    c = str(write_config(tmp / "c.yaml", cfg))
    async with running_guard(cfg) as guard:
        await hold(guard, upstream, "invoice:1")
        assert (await cli(capsys, "resolve", "acme", "invoice:1", "--as", "delivered", "-c", c))[0] == 0
        capsys.readouterr()
        code = await asyncio.to_thread(main, ["resolve", "acme", "invoice:1", "--as", "retry", "-c", c])
        err = capsys.readouterr().err
        assert code == 1 and "already resolved by cli:" in err, err
        for argv in (
            ["pause", "acme"],
            ["resume", "acme"],
            ["suppress", "add", "acme", "gone@example.net", "--reason", "asked"],
            ["suppress", "remove", "acme", "gone@example.net"],
        ):
            assert (await cli(capsys, *argv, "-c", c))[0] == 0, argv
        assert guard.store is not None
        log = list(reversed(await guard.store.audit_log("acme", 0)))
        assert [e.action for e in log] == [
            "decide:delivered",
            "pause",
            "resume",
            "suppress:add",
            "suppress:remove",
        ]
        assert all(e.actor.startswith("cli:") and "@" in e.actor for e in log)
        rec = await guard.store.get("acme", "invoice:1")
        assert rec is not None and rec.audit[-1].actor.startswith("cli:")
