"""Pause one message class (DESIGN.md §16): `pause ZONE --class C` holds that class on every
instance sharing the store within a second while the other classes flow. Relay mode answers
451 4.7.0 naming the class; queue mode accepts and holds the class's entries. Counted at a
real recording upstream."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from email.message import EmailMessage
from pathlib import Path
from typing import Any, cast

import pytest

from smtpguard.class_pauses import ClassPauses
from smtpguard.cli import main
from smtpguard.store import Store, StoreUnavailable, store_from_url
from tests.invariants.test_multi_instance import cli, is_451, two_instances
from tests.queue.test_queue import queue_config
from tests.support import Upstream, base_config, message, running_guard, send, write_config
from tests.support.console import Operator, console_config, console_port
from tests.support.eventually import eventually

SETTLE = 1.0
"""DESIGN.md §16: a class pause holds on every instance within this long."""


def of_class(key: str, message_class: str) -> EmailMessage:
    return message(key, headers={"X-Message-Class": message_class})


@pytest.mark.slow
async def test_paused_class_is_held_on_two_instances_while_the_other_class_flows(
    tmp: Path, upstream: Upstream
) -> None:
    async with two_instances(tmp, upstream) as pair:
        # Delivered before the pause: its duplicate must still answer 250 (DESIGN.md §3 order).
        first = await send(pair.port(0), of_class("bulk:delivered", "bulk"))
        assert first.code == 250 and "duplicate" not in first.text

        assert await asyncio.to_thread(cli, pair.configs[0], "pause", "acme", "--class", "bulk") == 0
        await asyncio.sleep(SETTLE)
        held = await asyncio.gather(*(send(pair.port(i), of_class(f"bulk:{i}", "Bulk")) for i in range(6)))
        flowing = await asyncio.gather(
            *(send(pair.port(i), of_class(f"tx:{i}", "transactional")) for i in range(6))
        )
        # No class header: the default class (transactional) flows too.
        plain = await send(pair.port(1), message("plain:1"))
        dups = await asyncio.gather(
            *(send(pair.port(i), of_class("bulk:delivered", "bulk")) for i in range(2))
        )
        during = Counter(upstream.event_keys())

        assert await asyncio.to_thread(cli, pair.configs[1], "resume", "acme", "--class", "bulk") == 0
        await asyncio.sleep(SETTLE)
        # The same keys again: a class pause recorded no attempt and started no
        # min_retry_interval (60 s here), so they are relayed now.
        after = await asyncio.gather(
            *(send(pair.port(i + 1), of_class(f"bulk:{i}", "bulk")) for i in range(6))
        )
    print(
        f"class pause on two instances: held {[r.code for r in held]}, flowing {[r.code for r in flowing]}, "
        f"after resume {[r.code for r in after]}; upstream {len(upstream.received)}"
    )
    assert all(is_451(r, "4.7.0") and "class bulk" in r.text and "paused" in r.text for r in held), [
        str(r) for r in held
    ]
    assert [r.code for r in flowing] == [250] * 6 and all("duplicate" not in r.text for r in flowing)
    assert plain.code == 250
    assert all(d.code == 250 and "duplicate" in d.text for d in dups), [str(d) for d in dups]
    assert during == Counter(["bulk:delivered", "plain:1", *(f"tx:{i}" for i in range(6))])
    assert [r.code for r in after] == [250] * 6 and all("duplicate" not in r.text for r in after)
    assert Counter(upstream.event_keys()) == during + Counter(f"bulk:{i}" for i in range(6))


async def test_queue_mode_accepts_a_paused_class_and_delivers_it_after_resume(
    tmp: Path, upstream: Upstream
) -> None:
    cfg = queue_config(tmp, upstream.port)
    path = write_config(tmp / "c.yaml", cfg)
    async with running_guard(cfg) as guard:
        assert await asyncio.to_thread(main, ["pause", "acme", "--class", "bulk", "-c", str(path)]) == 0
        # no wait: this server has not read the paused classes yet, its first look is fresh
        sent_at = time.time()
        bulk = [await send(guard.ports[0], of_class(f"qb{i}", "bulk")) for i in range(5)]
        tx = [await send(guard.ports[0], of_class(f"qt{i}", "transactional")) for i in range(5)]
        await upstream.wait_received(5)
        assert guard.store is not None
        store = guard.store

        # Each paused entry claimed and given back for the pause (due again later than it was
        # queued, not in_flight): only then does "none of them sent" mean anything.
        async def entries() -> dict[str, tuple[str, float]]:
            return {e.key: (e.state, e.due_at or 0.0) for e in await store.queue_entries("acme")}

        held = await eventually(
            entries,
            lambda w: len(w) == 5 and all(st == "queued" and due > sent_at for st, due in w.values()),
            timeout=10,
            interval=0.05,
        )
        during = Counter(upstream.event_keys())
        waiting = {k: st for k, (st, _) in held.items()}
        records = [await guard.store.get("acme", f"qb{i}") for i in range(5)]

        assert await asyncio.to_thread(main, ["resume", "acme", "--class", "bulk", "-c", str(path)]) == 0
        await upstream.wait_received(10)
        # A message queued after the last of them is delivered: the worker has claimed since.
        assert (await send(guard.ports[0], of_class("qt:after", "transactional"))).code == 250
        await upstream.wait_received(11)
    assert upstream.event_keys()[-1] == "qt:after"
    assert all(r.code == 250 and "queued as" in r.text for r in bulk + tx), [str(r) for r in bulk + tx]
    assert during == Counter(f"qt{i}" for i in range(5))
    assert waiting == {f"qb{i}": "queued" for i in range(5)}
    # Held, not tried: no attempt recorded while paused.
    assert all(r is not None and r.attempts == () for r in records)
    assert Counter(upstream.event_keys()) == during + Counter([*(f"qb{i}" for i in range(5)), "qt:after"])


def test_cli_class_pause_is_audited_shown_in_stats_and_refuses_unknown_classes(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp / "c.yaml", base_config(tmp, None))

    async def audit() -> list[tuple[str, str, str]]:
        # The first open creates the store, as `serve` would have.
        store = store_from_url(f"sqlite:///{tmp / 'state.db'}")
        await store.open()
        try:
            return [(e.action, e.key, e.actor) for e in await store.audit_log("acme", time.time() - 60)]
        finally:
            await store.close()

    assert asyncio.run(audit()) == []
    # Options anywhere, as every command takes them.
    assert main(["pause", "--json", "acme", "-c", str(path), "--class", "OTP"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "schema": 1,
        "zone": "acme",
        "class": "otp",
        "paused": True,
    }
    assert main(["pause", "acme", "--class", "newsletter", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown message class 'newsletter'" in err and "bulk, otp, transactional" in err
    assert main(["stats", "acme", "--json", "-c", str(path)]) == 0
    zone = json.loads(capsys.readouterr().out)["zones"][0]
    assert zone["paused_classes"] == ["otp"] and zone["paused"] is False
    assert main(["stats", "-c", str(path)]) == 0
    assert "paused classes: otp" in capsys.readouterr().out
    assert main(["resume", "acme", "--class", "otp", "-c", str(path)]) == 0
    assert "class otp of zone acme resumed" in capsys.readouterr().out
    assert main(["stats", "acme", "--json", "-c", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["zones"][0]["paused_classes"] == []

    entries = asyncio.run(audit())
    assert [(a, k) for a, k, _ in entries] == [("resume:class", "otp"), ("pause:class", "otp")]
    assert all(actor.startswith("cli:") and "@" in actor for _, _, actor in entries)


async def test_the_console_zone_page_shows_a_paused_class(tmp: Path, upstream: Upstream) -> None:
    async with running_guard(console_config(tmp, upstream)) as guard:
        op = Operator(console_port(guard))
        try:
            assert (await op.login("alice")).status == 200
            assert 'data-paused-class="bulk"' not in (await op.get("/")).text
            assert guard.store is not None
            await guard.store.set_class_paused("acme", "bulk", True)
            page = (await op.get("/")).text
        finally:
            await op.close()
    assert 'data-paused-class="bulk"' in page and "class bulk paused" in page


class PausedClassesUnreadable:
    """A store whose paused-classes read fails while every other call works: a hiccup that
    a real store cannot be made to have in exactly that read (a fault, not a stand-in)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    async def paused_classes(self) -> set[tuple[str, str]]:
        raise StoreUnavailable("paused classes unreadable")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_a_duplicate_is_answered_before_the_paused_classes_are_read(
    tmp: Path, upstream: Upstream
) -> None:
    """DESIGN.md §3 order: ledger lookup, then pause. A duplicate of a delivered event needs
    no pause at all, so it must not wait on (or fail with) the paused classes' read."""
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        first = await send(guard.ports[0], of_class("dup:1", "bulk"))
        assert guard.submitter is not None and guard.store is not None
        guard.submitter.class_pauses = ClassPauses(cast(Store, PausedClassesUnreadable(guard.store)))
        again = await send(guard.ports[0], of_class("dup:1", "bulk"))
        new = await send(guard.ports[0], of_class("dup:2", "bulk"))
    assert first.code == 250 and "duplicate" not in first.text
    assert again.code == 250 and "duplicate" in again.text, str(again)
    # A new event does need the read: unavailable, nothing sent (fail closed, as a reserve).
    assert is_451(new, "4.3.0"), str(new)
    assert upstream.event_keys() == ["dup:1"]


async def test_a_paused_class_named_twice_in_relay_mode_is_still_held(tmp: Path, upstream: Upstream) -> None:
    """The pause is a kill switch for a kind of mail: a message whose class header names the
    paused class twice (relay mode never validates the header) must not slip past it."""
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        assert guard.store is not None
        await guard.store.set_class_paused("acme", "bulk", True)
        # no wait: this server has not read the paused classes yet, its first look is fresh
        twice = message("bulk:twice")
        twice["X-Message-Class"] = "bulk"
        twice["X-Message-Class"] = "BULK"
        mixed = message("bulk:mixed")
        mixed["X-Message-Class"] = "transactional"
        mixed["X-Message-Class"] = "bulk"
        held = [await send(guard.ports[0], twice), await send(guard.ports[0], mixed)]
        flowing = await send(guard.ports[0], of_class("tx:once", "transactional"))
    assert all(is_451(r, "4.7.0") and "class bulk" in r.text for r in held), [str(r) for r in held]
    assert flowing.code == 250
    assert upstream.event_keys() == ["tx:once"]


class SlowToFail:
    """A store whose paused-classes read hangs for its timeout, then fails (a Redis failover
    whose old address stops answering); counts the reads."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.reads = 0

    async def paused_classes(self) -> set[tuple[str, str]]:
        self.reads += 1
        await asyncio.sleep(0.3)
        raise StoreUnavailable("timed out")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_sessions_waiting_on_a_failed_paused_classes_read_fail_with_it(tmp: Path) -> None:
    """Sessions that found the copy stale together wait for one read; when that read fails,
    they all answer at once (451 4.3.0 upstream of here), not one store timeout after another."""
    real = store_from_url(f"sqlite:///{tmp / 'state.db'}")
    await real.open()
    try:
        slow = SlowToFail(real)
        pauses = ClassPauses(cast(Store, slow))
        results = await asyncio.gather(*(pauses.paused() for _ in range(10)), return_exceptions=True)
        # The next look reads again: a failure is not remembered as an answer.
        again = await asyncio.gather(pauses.paused(), return_exceptions=True)
    finally:
        await real.close()
    assert all(isinstance(r, StoreUnavailable) for r in results + again), results
    # One read for the ten sessions (each in turn would be ten, one timeout after another),
    # and one more for the next look.
    assert slow.reads == 2


async def test_a_queued_entry_of_a_paused_class_past_its_max_age_expires_unsent(
    tmp: Path, upstream: Upstream
) -> None:
    """DESIGN.md §4a: never sent after its class's max_age, a pause notwithstanding (otp: 2 s
    here). Resuming later sends nothing of it; the other class flowed meanwhile."""
    cfg = queue_config(tmp, upstream.port)
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        await guard.store.set_class_paused("acme", "otp", True)
        # no wait: this server has not read the paused classes yet, its first look is fresh
        code = await send(guard.ports[0], of_class("otp:late", "otp"))
        tx = await send(guard.ports[0], of_class("tx:meanwhile", "transactional"))
        await upstream.wait_received(1)
        store = guard.store

        async def late() -> Any:
            return await store.get("acme", "otp:late")

        # held all along, until past otp's max_age
        expired = await eventually(
            late, lambda r: r is not None and r.state.value == "expired", timeout=10, interval=0.1
        )
        await guard.store.set_class_paused("acme", "otp", False)
        pauses = guard.submitter.class_pauses if guard.submitter is not None else None
        assert pauses is not None
        # This server sees the resume (its copy is REFRESH old at most) ...
        seen = await eventually(
            lambda: pauses.is_paused("acme", "otp"), lambda held: not held, timeout=5, interval=0.05
        )
        assert not seen
        # ... and the positive marker before the negative check: an otp message sent after
        # the resume arrives, so the worker has looked at the lane since; the expired one
        # was never sent.
        after = await send(guard.ports[0], of_class("otp:after", "otp"))
        await upstream.wait_received(2)
    assert code.code == 250 and "queued as" in code.text and tx.code == 250 and after.code == 250
    assert expired is not None and expired.state.value == "expired" and expired.attempts == ()
    assert upstream.event_keys() == ["tx:meanwhile", "otp:after"]


async def test_a_paused_backlog_is_not_re_claimed_every_second_and_resume_delivers_it_at_once(
    tmp: Path, upstream: Upstream
) -> None:
    """The runbook's case for a class pause is a flood: its backlog must sit still while
    paused (each entry held once, not claimed and given back every second: two record writes
    per entry per second for the whole backlog), and `resume --class` must still send it at
    once. Counted by record versions and at the upstream."""
    cfg = queue_config(tmp, upstream.port)
    path = write_config(tmp / "c.yaml", cfg)
    n = 60
    async with running_guard(cfg) as guard:
        assert guard.store is not None
        store = guard.store
        assert await asyncio.to_thread(main, ["pause", "acme", "--class", "bulk", "-c", str(path)]) == 0
        # no wait: this server has not read the paused classes yet, its first look is fresh
        sem = asyncio.Semaphore(10)

        async def submit(i: int) -> int:
            async with sem:
                return (await send(guard.ports[0], of_class(f"flood:{i}", "bulk"))).code

        codes = await asyncio.gather(*(submit(i) for i in range(n)))

        # Every entry claimed and held once (due again a pause's hold on, not in flight).
        async def due() -> list[float]:
            return [e.due_at or 0.0 for e in await store.queue_entries("acme") if e.state == "queued"]

        held = await eventually(
            due, lambda d: len(d) == n and min(d) > time.time() + 10, timeout=15, interval=0.05
        )
        assert len(held) == n and min(held) > time.time() + 10, sorted(held)[:3]

        async def versions() -> int:
            return sum([r.version for i in range(n) if (r := await store.get("acme", f"flood:{i}"))])

        before = await versions()
        await asyncio.sleep(3.0)  # the window the writes are counted over: ~30 worker polls
        # A message of another class sent at the window's end is delivered: the worker kept
        # claiming through it.
        assert (await send(guard.ports[0], of_class("tx:window", "transactional"))).code == 250
        await upstream.wait_received(1)
        writes = await versions() - before
        assert await asyncio.to_thread(main, ["resume", "acme", "--class", "bulk", "-c", str(path)]) == 0
        # At once, not when the entries' holds end: within this bound, a third of the 30 s
        # a paused class's entry is held for (class_pauses.HOLD).
        await upstream.wait_received(n + 1, timeout=10)
    print(f"{n} paused entries: {writes} record writes in 3 s")
    assert codes == [250] * n
    assert writes <= n // 10, writes
    assert Counter(upstream.event_keys()) == Counter([*(f"flood:{i}" for i in range(n)), "tx:window"])
