"""Receivers' store operations (DESIGN.md §21) on all three backends: a receiver's pause is a
zone control beside the class pauses (audited, read by every instance through ClassPauses),
and its max_rate is the providers' GCRA under a name of its own."""

from __future__ import annotations

import pytest

from smtpguard import desk
from smtpguard.class_pauses import ClassPauses
from smtpguard.config import ConfigError, loads
from smtpguard.metrics import Metrics
from smtpguard.policy.receivers import Shaping, control_name
from smtpguard.readiness.dns import DnsClient
from smtpguard.receivers import Receivers, shaping_of
from smtpguard.receivers.gate import ReceiverGate, slot_name
from smtpguard.store import Store
from tests.store.test_store_contract import NOW, store  # noqa: F401 - the three-backend fixture
from tests.support import FakeClock


async def test_a_receiver_pause_is_a_zone_control_every_reader_sees(store: Store) -> None:  # noqa: F811
    clock = FakeClock()
    pauses = ClassPauses(store, clock)
    gate = ReceiverGate(store, pauses, lambda: {}, lambda: NOW)
    assert not await gate.paused("acme", "yahoo")
    await desk.set_receiver_paused(store, "acme", "yahoo", True, "cli:alice@host")
    await store.set_class_paused("acme", "bulk", True)
    clock.t += 1  # past ClassPauses.REFRESH: the next read asks the store
    assert await gate.paused("acme", "yahoo")
    assert not await gate.paused("globex", "yahoo") and not await gate.paused("acme", "gmail")
    pairs = await store.paused_classes()
    assert desk.split_controls(pairs, "acme") == (["bulk"], ["yahoo"])
    audit = await store.audit_log("acme", 0)
    assert [(a.actor, a.action, a.key) for a in audit] == [("cli:alice@host", "pause:receiver", "yahoo")]
    await desk.set_receiver_paused(store, "acme", "yahoo", False, "cli:alice@host")
    clock.t += 1
    assert not await gate.paused("acme", "yahoo")
    assert await store.paused_classes() == {("acme", "bulk")}


async def test_a_receiver_max_rate_is_its_own_gcra(store: Store) -> None:  # noqa: F811
    shaping = {"acme": {"microsoft": Shaping(max_rate=1.0)}}
    gate = ReceiverGate(store, ClassPauses(store), lambda: shaping, lambda: NOW)
    granted = [await gate.slot("acme", "microsoft") for _ in range(4)]
    # One second of burst at 1/s: the slot now and the next one; then refused until one frees.
    assert [g[0] for g in granted if g is not None] == [True, True, False, False]
    refusal = await gate.rcpt_refusal("acme", "microsoft")
    assert refusal is not None and (refusal.code, refusal.enhanced) == (451, "4.7.1")
    # No max_rate: no slot taken; a provider of the same name keeps its own slots.
    assert await gate.slot("acme", "gmail") is None and await gate.rcpt_refusal("acme", "gmail") is None
    assert (await store.rate_slot("microsoft", 1.0, 0.0, NOW)).granted
    assert slot_name("acme", "microsoft") == "receiver:acme:microsoft"


def test_a_class_may_not_take_the_receivers_prefix() -> None:
    text = """
listen: [{address: "127.0.0.1:0", tls: none}]
providers: [{name: p, kind: maildir, path: /tmp/x}]
queue: {default_class: transactional, classes: {transactional: {max_age: 1d, priority: 0},
        "receiver:x": {max_age: 1d, priority: 1}}}
zones: {acme: {senders: ["@acme.test"]}}
"""
    with pytest.raises(ConfigError, match=r"queue\.classes\.receiver:x .*receivers' pauses"):
        loads(text)
    assert control_name("x") == "receiver:x"


async def test_a_queued_entry_with_more_recipients_than_one_burst_is_sent(store: Store) -> None:  # noqa: F811
    """Queue mode takes one slot per recipient. An entry with more of a receiver's recipients
    than one burst holds (here 3 at 1/s: two fit) must still go, once it has gathered its
    slots, rather than take one slot per try, lose it and wait again for ever; and the
    slots it gathered are not handed out twice."""
    clock = FakeClock()
    clock.t = NOW
    shaping = {"acme": {"microsoft": Shaping(max_rate=1.0)}}
    gate = ReceiverGate(store, ClassPauses(store), lambda: shaping, clock)
    tries = 0
    until = await gate.hold_until("acme", "k1", {"microsoft": 3})
    while until is not None and tries < 20:
        tries += 1
        clock.t = until
        until = await gate.hold_until("acme", "k1", {"microsoft": 3})
    assert until is None, f"still held after {tries} tries"
    assert tries <= 3
    # Sent at NOW + ~1 s with three slots spent: the next recipient waits for one to free.
    assert await gate.hold_until("acme", "k2", {"microsoft": 1}) is not None


SLOW_CONFIG = """
listen: [{address: "127.0.0.1:0", tls: none}]
providers: [{name: p, kind: maildir, path: /tmp/x}]
dns: {nameservers: ["127.0.0.1:9"]}
zones:
  acme:
    senders: ["@acme.test"]
    receivers:
      microsoft: {max_rate: 1/s, on_alert: slow, alert: {complaint_rate: 50%, window: 1h, min_sends: 1}}
"""


async def test_on_alert_slow_reaches_every_worker(store: Store) -> None:  # noqa: F811
    """One process per host judges the alerts (worker 0); `slow` must halve the receiver's
    rate in every worker and instance taking its slots, not in the judge alone, and end
    with the window."""
    config = loads(SLOW_CONFIG)
    clock = FakeClock()
    clock.t = (NOW // 3600) * 3600 + 60
    dns = DnsClient(config.dns)
    judge = Receivers(
        config, dns, store, ClassPauses(store, clock), Metrics(), lambda z, n: None, clock, False
    )
    worker = ReceiverGate(store, ClassPauses(store, clock), lambda: shaping_of(config), clock)

    async def granted_now(gate: ReceiverGate, receiver: str) -> int:
        got = [await gate.slot("acme", receiver) for _ in range(3)]
        return sum(1 for g in got if g is not None and g[0])

    try:
        assert await judge.alerts.refresh() == []  # the window's first reading
        await store.add_counts("acme", {"receiver:microsoft:sent": 2, "receiver:microsoft:complaint": 1})
        assert await judge.alerts.refresh() == [("acme", "microsoft", "complaint_rate")]
        await judge.alerts.refresh()  # the next look changes nothing
        clock.t += 5  # past the workers' copy of the store's controls
        # At 1/s with a second of burst, two slots now; halved (one per 2 s), one.
        assert await granted_now(worker, "microsoft") == 1
        assert await granted_now(judge.gate, "microsoft") == 0  # the same fleet-wide slots
        clock.t += 3600  # the next window: the judge lifts it
        await judge.alerts.refresh()
        clock.t += 5
        assert await granted_now(worker, "microsoft") == 2
    finally:
        await judge.close()


async def test_queued_entries_refused_a_slot_take_turns(store: Store) -> None:  # noqa: F811
    """Fifty entries of one receiver at 1/s, each tried when its hold ends (the worker's
    loop, on an injected clock). Refused a slot, an entry must not wake with all the others
    at every slot that frees to ask again: that herd asks ~N times a second (here ~1,250
    asks before the 50th entry goes), each a claim and a store write."""
    clock = FakeClock()
    clock.t = NOW
    shaping = {"acme": {"microsoft": Shaping(max_rate=1.0)}}
    gate = ReceiverGate(store, ClassPauses(store), lambda: shaping, clock)
    due = [(NOW, i) for i in range(50)]
    sent: list[tuple[float, int]] = []
    tries = 0
    while due and tries < 2000:
        due.sort()
        at, i = due.pop(0)
        clock.t = max(clock.t, at)
        tries += 1
        until = await gate.hold_until("acme", f"k{i}", {"microsoft": 1})
        if until is None:
            sent.append((clock.t, i))
        else:
            due.append((until, i))
    assert len(sent) == 50, f"{len(sent)} sent after {tries} asks"
    assert tries <= 100, f"{tries} asks for 50 sends"
    assert [i for _, i in sent] == list(range(50))  # in the order they were refused
    # Never over the rate: at most rate * (W + 1) + 1 in any window W from NOW.
    assert all(n + 1 <= 1.0 * (t - NOW + 1) + 1 for n, (t, _) in enumerate(sent))
    assert sent[-1][0] - NOW <= 50  # and the rate used: a slot each second
