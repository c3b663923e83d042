"""One decision vocabulary (DESIGN.md §14): the name each submission's decision is counted
under in /metrics and in the store's per-zone stats (what `smtpguard stats` shows).

Through the real listener, a recording upstream, a real SQLite store and a real HTTP
client: one submission per decision, then the metrics page and the stored counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.decisions import Decision, relayed_as, stat_name
from smtpguard.policy.outcome import Kind
from smtpguard.store import store_from_url
from tests.ops.test_ops import http_get
from tests.ops.test_ops import sample as labelled
from tests.support import Behaviour, Upstream, base_config, message, running_guard, send

# What each submission below is counted as: (metrics decision label, stored stat name).
EXPECTED = {
    "relayed": ("relayed", "sent"),
    "duplicate": ("duplicate", "duplicate"),
    "deferred": ("deferred", "deferred"),
    "failed": ("failed", "failed"),
    "rejected:key": ("rejected:key", "rejected:key"),
    "cap_hour": ("cap_hour", "cap_hour"),
}


async def test_each_decision_keeps_its_name_in_metrics_and_stats(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(
        tmp,
        upstream.port,
        metrics={"address": "127.0.0.1:0"},
        zones__acme__hourly_cap=3,
        event_key__min_retry_interval="0s",
    )
    upstream.handler.script = [Behaviour(), Behaviour(data="451 4.3.0 later"), Behaviour(data="554 5.6.0 no")]
    async with running_guard(cfg) as guard:
        port = guard.ports[0]
        codes = [
            (await send(port, message("d:1"))).code,  # relayed
            (await send(port, message("d:1"))).code,  # duplicate
            (await send(port, message("d:2"))).code,  # deferred after DATA: a unit spent
            (await send(port, message("d:3"))).code,  # failed after DATA: a unit spent
            (await send(port, message(None))).code,  # no key: rejected
            (await send(port, message("d:4"))).code,  # the hourly cap of 3 is used up
        ]
        assert guard.health is not None
        _, body = await http_get(guard.health.port, "/metrics")
    print(f"decisions: replies {codes}")
    assert codes == [250, 250, 451, 554, 550, 451]
    store = store_from_url(cfg["store"]["url"])
    await store.open()
    try:
        counts = await store.counts("acme")
    finally:
        await store.close()
    count = "smtpguard_submission_latency_seconds_count"
    for label, stat in EXPECTED.values():
        assert labelled(body, count, zone="acme", decision=label) == 1, label
        assert counts.get(stat) == 1, (stat, counts)
    assert "relayed" not in counts and "delivered" not in counts


@pytest.mark.parametrize(
    ("kind", "decision"),
    [
        (Kind.DELIVERED, Decision.RELAYED),
        (Kind.DEFERRED, Decision.DEFERRED),
        (Kind.FAILED, Decision.FAILED),
        (Kind.UNKNOWN, Decision.UNKNOWN),
        (Kind.UNAVAILABLE, Decision.UNAVAILABLE),
    ],
)
def test_an_outcome_kind_names_one_decision_and_one_stat(kind: Kind, decision: Decision) -> None:
    assert relayed_as(kind) is decision
    assert stat_name(decision) == ("sent" if kind is Kind.DELIVERED else kind.value)


def test_decisions_are_their_strings() -> None:
    # Byte-identical on the wire, in the store, logs, metrics and JSON: a member is its value.
    assert [str(d) for d in Decision] == [d.value for d in Decision]
    assert stat_name("paused") == "paused" and stat_name(Decision.RELAYED) == "sent"
