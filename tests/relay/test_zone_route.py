"""Per-zone route (DESIGN.md §16): `zones.Z.providers` reorders or restricts the route for
one zone, in relay and queue mode; a name that is not a provider is refused at load with its
YAML path. Real clients, two counting upstreams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from smtpguard.cli import main
from smtpguard.config import ConfigError, loads
from tests.support import (
    OTHER_PASSWORD,
    Behaviour,
    Upstream,
    base_config,
    message,
    send,
    settled_records,
    write_config,
)


def provider(name: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "smtp",
        "host": "127.0.0.1",
        "port": port,
        "tls": "none",
        "timeouts": {"connect": "2s", "command": "3s", "data": "2s"},
        "pool_size": 2,
    }


async def two_upstreams() -> tuple[Upstream, Upstream]:
    primary, standby = Upstream(), Upstream()
    await primary.start()
    await standby.start()
    return primary, standby


@pytest.mark.parametrize("delivery", ["relay", "queue"])
async def test_a_zone_with_its_own_route_goes_only_there(tmp: Path, delivery: str) -> None:
    from tests.support import running_guard

    primary, standby = await two_upstreams()
    try:
        cfg = base_config(tmp, None, zones__acme__providers=["standby"], zones__acme__delivery=delivery)
        cfg["providers"] = [provider("primary", primary.port), provider("standby", standby.port)]
        cfg["queue"] = {"backoff": {"base": "100ms", "max": "500ms"}, "poll_interval": "100ms"}
        async with running_guard(cfg) as guard:
            port = guard.ports[0]
            for i in range(3):
                assert (await send(port, message(f"a{i}"))).code == 250
                assert (
                    await send(
                        port,
                        message(f"g{i}", sender="news@globex.example"),
                        user="globex-app",
                        password=OTHER_PASSWORD,
                        sender="news@globex.example",
                    )
                ).code == 250
            await standby.wait_received(3)
            await primary.wait_received(3)
            if delivery == "queue":
                await settled_records(cfg["store"]["url"], "acme", [f"a{i}" for i in range(3)])
    finally:
        await primary.stop()
        await standby.stop()
    # Zone acme (providers: [standby]) never reached the primary; globex took the default route.
    assert sorted(standby.event_keys()) == ["a0", "a1", "a2"]  # type: ignore[type-var]
    assert sorted(primary.event_keys()) == ["g0", "g1", "g2"]  # type: ignore[type-var]


async def test_a_zone_route_reorders_and_still_fails_over_before_data(tmp: Path) -> None:
    from tests.support import running_guard

    primary, standby = await two_upstreams()
    try:
        cfg = base_config(tmp, None, zones__acme__providers=["standby", "primary"])
        cfg["providers"] = [provider("primary", primary.port), provider("standby", standby.port)]
        async with running_guard(cfg) as guard:
            assert (await send(guard.ports[0], message("r1"))).code == 250
            # Its zone's first choice refuses for now before DATA: the next on its route.
            standby.handler.default = Behaviour(mail="451 4.3.0 try later")
            assert (await send(guard.ports[0], message("r2"))).code == 250
    finally:
        await primary.stop()
        await standby.stop()
    assert standby.event_keys() == ["r1"]
    assert primary.event_keys() == ["r2"]


def _config_text(tmp: Path, zone_providers: object) -> str:
    cfg = base_config(tmp, None)
    cfg["providers"] = [provider("primary", 2525), provider("standby", 2526)]
    cfg["zones"]["acme"]["providers"] = zone_providers
    return yaml.safe_dump(cfg, sort_keys=False)


def test_an_unknown_provider_in_a_zone_route_is_refused_with_its_path(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _config_text(tmp, ["standby", "secondary"])
    path = write_config(tmp / "c.yaml", yaml.safe_load(text))
    assert main(["check-config", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "zones.acme.providers[1]" in err
    assert "'secondary' is not one of providers: primary, standby" in err


@pytest.mark.parametrize(
    ("value", "where", "says"),
    [
        ([], "zones.acme.providers", "must not be empty"),
        (["primary", "primary"], "zones.acme.providers[1]", "listed twice"),
        ("primary", "zones.acme.providers", "list"),
    ],
)
def test_a_bad_zone_route_is_refused(tmp: Path, value: object, where: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        loads(_config_text(tmp, value))
    problem = "\n".join(e.value.problems)
    assert where in problem and says in problem, problem


@pytest.mark.parametrize("delivery", ["relay", "queue"])
async def test_a_reload_that_changes_only_a_zone_route_takes_effect(tmp: Path, delivery: str) -> None:
    """SIGHUP with the providers unchanged and only `zones.acme.providers` edited: the next
    message follows the new route (the route was rebuilt only when `providers` changed, so
    the edit was reported applied and silently ignored)."""
    from tests.support import running_guard

    primary, standby = await two_upstreams()
    try:
        cfg = base_config(tmp, None, zones__acme__providers=["primary"], zones__acme__delivery=delivery)
        cfg["providers"] = [provider("primary", primary.port), provider("standby", standby.port)]
        cfg["queue"] = {"backoff": {"base": "100ms", "max": "500ms"}, "poll_interval": "100ms"}
        path = tmp / "c.yaml"
        async with running_guard(cfg, config_path=path) as guard:
            port = guard.ports[0]
            assert (await send(port, message("before"))).code == 250
            await primary.wait_received(1)
            cfg["zones"]["acme"]["providers"] = ["standby"]
            write_config(path, cfg)
            assert await guard.reload()
            assert (await send(port, message("after"))).code == 250
            await standby.wait_received(1)
            # A zone route added by a reload applies too; one removed falls back to the top.
            cfg["zones"]["globex"]["providers"] = ["standby"]
            del cfg["zones"]["acme"]["providers"]
            write_config(path, cfg)
            assert await guard.reload()
            assert (await send(port, message("back"))).code == 250
            assert (
                await send(
                    port,
                    message("g1", sender="news@globex.example"),
                    user="globex-app",
                    password=OTHER_PASSWORD,
                    sender="news@globex.example",
                )
            ).code == 250
            await primary.wait_received(2)
            await standby.wait_received(2)
    finally:
        await primary.stop()
        await standby.stop()
    assert primary.event_keys() == ["before", "back"]
    assert standby.event_keys() == ["after", "g1"]


async def test_smtputf8_at_rcpt_is_judged_on_the_zones_own_route(tmp: Path) -> None:
    """The top-level route's primary offers SMTPUTF8; zone acme's own route is a standby that
    does not. Once both have answered an EHLO, acme's non-ASCII recipient is refused at RCPT
    with 553 5.6.7 (DESIGN.md §3: "the route's provider does not offer it") — not accepted
    for the primary's SMTPUTF8, reserved, then refused after DATA by its own provider."""
    from tests.support import PASSWORD, running_guard
    from tests.support.utf8 import raw_message, transact, utf8_upstream

    async with utf8_upstream() as primary:
        standby = Upstream()
        await standby.start()
        try:
            cfg = base_config(tmp, None, zones__acme__providers=["standby"])
            cfg["providers"] = [provider("primary", primary.port), provider("standby", standby.port)]
            async with running_guard(cfg) as guard:
                port = guard.ports[0]
                # One ASCII message on each route: both providers' EHLOs are known.
                globex = await transact(
                    port,
                    "news@globex.example",
                    ["customer@example.com"],
                    raw_message("g1", sender="news@globex.example"),
                    user="globex-app",
                    password=OTHER_PASSWORD,
                )
                assert globex.data is not None and globex.data.code == 250, globex
                acme = await transact(
                    port, "billing@acme.example", ["customer@example.com"], raw_message("a1")
                )
                assert acme.data is not None and acme.data.code == 250, acme
                t = await transact(
                    port,
                    "billing@acme.example",
                    ["jöe@example.net", "customer@example.com"],
                    raw_message("a2"),
                    smtputf8=True,
                    password=PASSWORD,
                )
                assert guard.store is not None
                record = await guard.store.get("acme", "a2")
        finally:
            await standby.stop()
    assert [a.code for a in t.rcpts] == [553, 250], t
    assert t.rcpts[0].text.startswith("5.6.7") and "SMTPUTF8" in t.rcpts[0].text
    assert t.data is not None and t.data.code == 250, t
    assert [r.rcpt_tos for r in standby.received] == [["customer@example.com"], ["customer@example.com"]]
    assert record is not None and record.state.value == "delivered"
