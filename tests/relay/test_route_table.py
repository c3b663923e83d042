"""The route carries out the failover table (tests/policy/test_failover.py): the same rows,
walked by Route over providers that answer from a script, with no connection."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from smtpguard.policy.breaker import Circuit
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.relay import Attempted, Envelope, Route
from tests.policy.test_failover import B_DELIVERS, B_LIMITED, DELIVERED, NOW, ROWS, UTF8, Row


@dataclass
class Scripted:
    """A provider that answers from a script: the route's inputs, with no connection."""

    name: str
    answers: list[Attempted]
    idempotent: bool = False
    smtputf8: bool | None = True
    event_tag: str | None = None
    sent: int = 0

    async def send(self, env: Envelope, before_data: object) -> Attempted:
        self.sent += 1
        return self.answers.pop(0)

    async def close(self) -> None:
        return None


ENV = Envelope("z", "k", "att", "s@example.org", ("r@example.org",), b"Subject: x\r\n\r\nx\r\n")


async def _mark(provider: str) -> None:
    return None


async def walk(row: Row) -> tuple[Outcome, bool, Circuit]:
    a = Scripted("a", [row.first, *([row.retry] if row.retry else [])], idempotent=row.idempotent)
    providers = [a]
    b = Scripted("b", [B_LIMITED if row.rest == "limited" else B_DELIVERS])
    if row.rest != "none":
        providers.append(b)
    route = Route(providers, threshold=1, cooldown=60, clock=lambda: NOW)
    if row.rest == "open":
        route.breakers["b"] = route.breakers["b"].trip(NOW)

    outcome = await route.send(ENV, _mark)
    assert a.sent == (2 if row.retry else 1)
    return outcome, b.sent == 1, route.breakers["a"].circuit


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
async def test_the_route_table(row: Row) -> None:
    outcome, b_tried, a_circuit = await walk(row)
    assert (outcome.kind, outcome.provider, b_tried, outcome.wait_until, a_circuit) == (
        row.kind,
        row.provider,
        row.b_tried,
        row.wait_until,
        row.a_circuit,
    )


async def test_every_circuit_open_tries_nothing_and_says_so() -> None:
    a = Scripted("a", [DELIVERED])
    route = Route([a], threshold=1, cooldown=60, clock=lambda: NOW)
    route.breakers["a"] = route.breakers["a"].trip(NOW)
    outcome = await route.send(ENV, _mark)
    assert a.sent == 0
    assert outcome == Outcome(
        Kind.UNAVAILABLE, None, detail="every provider circuit is open", data_sent=False
    )


async def test_a_refusal_for_what_one_provider_lacks_is_retryable_while_another_is_out() -> None:
    outcome, _, _ = await walk(ROWS["no-smtputf8-open"])
    assert outcome == Outcome(
        Kind.UNAVAILABLE, "a", detail=f"{UTF8}; another provider unavailable", data_sent=False
    )
