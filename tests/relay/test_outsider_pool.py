"""A pooled upstream connection that the provider drops before DATA, as an outsider's
provider does (an idle timer, a load balancer cutting long-lived sessions, a restart).

Nothing of the message has been sent until DATA: a pooled connection that goes away
between MAIL and the last RCPT has cost the event nothing, and a relay asks again once on
a fresh connection (as Postfix's smtp client does with a cached session) instead of
answering the client 451 and counting the drop against the provider's circuit. Counted at
the scripted upstream: messages received, connections opened."""

from __future__ import annotations

from pathlib import Path

import pytest

from smtpguard.policy.ledger import Record
from smtpguard.policy.outcome import Kind
from smtpguard.replies import Reply
from tests.relay.test_resilience import routed, smtp_provider
from tests.relay.test_wire_attacks import CLOSE, HALF, OTHER, Scripted, _env, _provider, _send_all
from tests.support import message as email
from tests.support import running_guard, send

pytestmark = pytest.mark.usefixtures("no_tracebacks")

OK_RCPT = b"250 2.1.5 ok\r\n"


async def _two_messages(tmp: Path, up: Scripted) -> tuple[Reply, Reply, Record | None]:
    """pool:1 through a guard relaying to `up` (its connection stays in the pool), then
    pool:2 on that pooled connection: both replies, and pool:2's record afterwards."""
    cfg = routed(tmp, smtp_provider("primary", up.port))
    async with running_guard(cfg) as guard:
        first = await send(guard.ports[0], email("pool:1"))
        second = await send(guard.ports[0], email("pool:2"))
        assert guard.store is not None
        return first, second, await guard.store.get("acme", "pool:2")


@pytest.mark.parametrize(
    ("pipelining", "fault"),
    [(True, CLOSE), (False, CLOSE), (True, b"421 4.4.2 idle timeout exceeded\r\n")],
    ids=["pipelined", "lock-step", "421"],
)
async def test_a_pooled_connection_dropped_at_rcpt_is_retried_once_on_a_fresh_one(
    tmp: Path, pipelining: bool, fault: bytes
) -> None:
    # The first message leaves its connection in the pool; on the second transaction the
    # provider answers MAIL, then closes (or says 421, ending the session) at RCPT.
    async with Scripted(pipelining=pipelining, rcpt=[OK_RCPT, fault]) as up:
        first, second, record = await _two_messages(tmp, up)
    assert first.code == 250, first
    assert second.code == 250, second
    assert record is not None and record.state == "delivered"
    assert len(up.messages) == 2 and up.connections == 2
    assert sum(m.count(b"X-Event-Key: pool:2") for m in up.messages) == 1


async def test_a_pooled_connection_dropped_after_a_recipient_was_taken_is_retried(tmp: Path) -> None:
    # Two recipients: the first is taken, the connection is gone before the second's reply.
    async with Scripted(rcpt=[OK_RCPT, OK_RCPT, CLOSE]) as up:
        first, second = await _send_all(
            _provider(tmp, up.port), _env("p1"), _env("p2", OTHER, "third@example.com")
        )
    assert first.outcome.kind is Kind.DELIVERED
    assert second.outcome.kind is Kind.DELIVERED, second.outcome
    assert second.outcome.accepted == (OTHER, "third@example.com")
    assert up.connections == 2 and len(up.messages) == 2


async def test_the_retry_is_once_a_fresh_connection_that_drops_too_is_unavailable(tmp: Path) -> None:
    # A fresh connection dropped at RCPT is the provider's answer, not a stale pool: no
    # third connection, nothing sent, the event stays retryable.
    async with Scripted(rcpt=[OK_RCPT, CLOSE, CLOSE]) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("p1"), _env("p2"))
    assert first.outcome.kind is Kind.DELIVERED
    assert second.outcome.kind is Kind.UNAVAILABLE and second.failover, second.outcome
    assert not second.outcome.data_sent
    assert up.connections == 2 and len(up.messages) == 1


@pytest.mark.parametrize("fault", [CLOSE, b"421 4.4.2 idle timeout exceeded\r\n"], ids=["closed", "421"])
async def test_a_pooled_connection_lost_at_the_data_command_is_retried_before_the_message(
    tmp: Path, fault: bytes
) -> None:
    # DATA is answered by a close (or 421) instead of 354: the message was never written.
    async with Scripted(data=[b"354 go ahead\r\n", fault]) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("p1"), _env("p2"))
    assert first.outcome.kind is Kind.DELIVERED
    assert second.outcome.kind is Kind.DELIVERED, second.outcome
    assert up.connections == 2 and len(up.messages) == 2
    assert sum(m.count(b"X-Event-Key: p2") for m in up.messages) == 1


async def test_a_pooled_connection_lost_after_the_354_is_never_asked_again(tmp: Path) -> None:
    # Once the message is being written the outcome is the provider's: unknown, one copy
    # at most, no second connection.
    async with Scripted(data=[b"354 go ahead\r\n", HALF]) as up:
        first, second = await _send_all(_provider(tmp, up.port), _env("p1"), _env("p2"))
    assert first.outcome.kind is Kind.DELIVERED
    assert second.outcome.kind is Kind.UNKNOWN and not second.failover, second.outcome
    assert up.connections == 1 and len(up.messages) == 1


async def test_a_retry_lost_at_the_data_command_again_leaves_the_event_not_sent(tmp: Path) -> None:
    # The pooled connection and the fresh one both close at DATA, before any 354: nothing
    # of the message went out, so the event is not `unknown` (§11.6) but may be retried.
    # The data_sent mark is written once for the attempt, whichever connection carried it.
    async with Scripted(data=[b"354 go ahead\r\n", CLOSE, CLOSE]) as up:
        first, second, record = await _two_messages(tmp, up)
    assert first.code == 250, first
    assert second.code // 100 == 4 and "unknown" not in second.text, second
    assert record is not None and record.state == "deferred", record
    assert up.connections == 2 and len(up.messages) == 1
