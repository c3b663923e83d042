"""End to end: real client → smtpguard listener → real recording upstream, SQLite store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support import OTHER_PASSWORD, Behaviour, Upstream, base_config, message, running_guard, send


async def test_same_key_twice_reaches_upstream_once(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        port = guard.ports[0]
        first = await send(port, message("invoice:acme:1044"))
        second = await send(port, message("invoice:acme:1044"))
    assert first.code == 250 and "[sg:" in first.text and "queued as Q1" in first.text
    assert second.code == 250 and "duplicate" in second.text
    # The duplicate carries the original smtpguard id and upstream queue id.
    sg_id = first.text.split("[sg:")[1].split("]")[0]
    assert sg_id in second.text and "Q1" in second.text
    assert upstream.event_keys() == ["invoice:acme:1044"]


async def test_twenty_concurrent_submissions_of_one_key(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.default = Behaviour(hang_after_dot=0.3)
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        replies = await asyncio.gather(*(send(guard.ports[0], message("order:77")) for _ in range(20)))
    assert len(upstream.received) == 1
    assert [r.code for r in replies].count(250) == 20
    assert sum("duplicate" in r.text for r in replies) == 19


async def test_restart_between_sends_keeps_the_ledger(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port)
    async with running_guard(cfg) as guard:
        first = await send(guard.ports[0], message("reset:9"))
    async with running_guard(cfg) as guard:
        second = await send(guard.ports[0], message("reset:9"))
    assert first.code == 250 and second.code == 250 and "duplicate" in second.text
    assert len(upstream.received) == 1


async def test_upstream_4xx_then_retry_is_held_by_min_retry_interval(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.script = [Behaviour(data="451 4.3.0 try again later")]
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        first = await send(guard.ports[0], message("k4"))
        second = await send(guard.ports[0], message("k4"))
    assert first.code == 451 and first.text.startswith("4.3.0 [sg:")
    assert second.code == 451 and "4.7.1" in second.text and "retry after" in second.text
    assert upstream.handler.transactions == 1 and upstream.received == []


async def test_upstream_5xx_is_repeated_without_resending(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.script = [Behaviour(data="554 5.6.0 content rejected")]
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        first = await send(guard.ports[0], message("k5"))
        second = await send(guard.ports[0], message("k5"))
    assert first.code == 554 and "content rejected" in first.text
    assert second.code == 554 and "content rejected" in second.text
    assert upstream.handler.transactions == 1


async def test_hang_after_dot_is_unknown_and_never_resent(tmp: Path, upstream: Upstream) -> None:
    upstream.handler.script = [Behaviour(hang_after_dot=10)]
    cfg = base_config(tmp, upstream.port)
    cfg["providers"][0]["timeouts"]["data"] = "1s"
    async with running_guard(cfg) as guard:
        first = await send(guard.ports[0], message("k6"))
        second = await send(guard.ports[0], message("k6"))
    assert first.code == 451 and "unknown" in first.text
    assert second.code == 451 and second.text.startswith("4.3.0") and "held" in second.text
    # The upstream got the message once (it took it, then never answered): no second copy.
    assert len(upstream.received) == 1 and upstream.handler.transactions == 1


async def test_key_reused_with_different_message(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        await send(guard.ports[0], message("k7", body="first"))
        reused = await send(guard.ports[0], message("k7", body="second"))
    assert reused.code == 550 and reused.text.startswith("5.7.0") and "reused" in reused.text
    assert len(upstream.received) == 1


async def test_missing_message_id_is_derived_from_zone_and_key(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        await send(guard.ports[0], message("k8"))
    mid = upstream.received[0].header("Message-ID")
    assert mid is not None and mid.startswith("<sg.") and mid.endswith("@guard.test>")


async def test_free_plan_has_no_send_as(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port, zones__acme__plan="free")
    async with running_guard(cfg) as guard:
        reply = await send(guard.ports[0], message("f1"))
    assert reply.code == 550 and reply.text.startswith("5.7.1") and "send-as" in reply.text
    assert upstream.received == []


async def test_missing_key_reject_derive_allow(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port)
    cfg["zones"]["globex"]["missing_key"] = "derive"
    cfg["zones"]["acme"]["missing_key"] = "reject"
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        rejected = await send(port, message(None))
        globex = {"user": "globex-app", "password": OTHER_PASSWORD, "sender": "news@globex.example"}
        clicks = [await send(port, message(None, sender="news@globex.example"), **globex) for _ in range(2)]
    assert rejected.code == 550 and rejected.text.startswith("5.7.0") and "X-Event-Key" in rejected.text
    # derive: the double-click of an app that cannot set headers is caught
    assert clicks[0].code == 250 and clicks[1].code == 250 and "duplicate" in clicks[1].text
    assert len(upstream.received) == 1

    cfg["zones"]["acme"]["missing_key"] = "allow"
    async with running_guard(cfg) as guard:
        allowed = [await send(guard.ports[0], message(None)) for _ in range(2)]
    assert [r.code for r in allowed] == [250, 250]
    assert len(upstream.received) == 3  # allow: no key, no idempotency, as configured
