"""The ledger's side of a recipient held at RCPT by its receiver (DESIGN.md §21): the
transaction's fingerprint covers every recipient the client named, `owed` the held ones; the
client's retry of the held ones alone is the rest of the event, sent once the accepted
recipients' send is delivered, and never mistaken for a reused key. Pure: no store, no
sockets, the clock a number."""

from __future__ import annotations

from dataclasses import replace

from smtpguard.policy import ledger
from smtpguard.policy.decisions import Decision
from smtpguard.policy.events import Match
from smtpguard.policy.ledger import Answer, LedgerSettings, Proceed, Record, State, Submission
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.policy.verdict_records import attempt_of, names_the_message
from smtpguard.replies import Reply

S = LedgerSettings(min_retry_interval=60.0, lease=30.0)
T0 = 1_700_000_000.0
WHOLE, REST, ELSE = "a" * 64, "b" * 64, "c" * 64
DELIVERED = Outcome(Kind.DELIVERED, "primary", Reply(250, "2.0.0", "ok"), upstream_id="Q1")
DEFERRED = Outcome(Kind.DEFERRED, "primary", Reply(451, "4.3.0", "later"))
FAILED = Outcome(Kind.FAILED, "primary", Reply(550, "5.7.1", "no"))
UNKNOWN = Outcome(Kind.UNKNOWN, "primary", None, detail="timeout after the dot", data_sent=True)


def sub(fingerprint: str, attempt: str, owed: str | None = None, tags: tuple[str, ...] = ()) -> Submission:
    return Submission("acme", "k1", fingerprint, attempt, "i-1", "<m@app>", owed=owed, rcpt_tags=tags)


def first_delivered() -> Record:
    verdict = ledger.decide(None, sub(WHOLE, "A1", owed=REST, tags=("tg",)), T0, S)
    assert isinstance(verdict, Proceed) and verdict.record.owed == REST
    done = ledger.settle(verdict.record, "A1", "i-1", DELIVERED, T0 + 1, S)
    assert done.state is State.DELIVERED
    return done


def test_the_retry_of_the_held_recipients_is_sent_once() -> None:
    done = first_delivered()
    verdict = ledger.decide(done, sub(REST, "A2", tags=("ty",)), T0 + 600, S)
    assert isinstance(verdict, Proceed), verdict
    rest = verdict.record
    assert (rest.state, rest.sg_id, rest.fingerprint, rest.parts, rest.owed) == (
        State.IN_FLIGHT,
        "A2",
        REST,
        (WHOLE,),
        None,
    )
    # A provider event about either transaction's recipients still finds its record.
    assert set(rest.rcpt_tags) == {"tg", "ty"}
    assert [e.action for e in rest.audit][-1] == "rest"
    sent = ledger.settle(rest, "A2", "i-1", DELIVERED, T0 + 601, S)
    # Resubmitted again, the rest or the whole transaction: a duplicate, nothing sent.
    for fp in (REST, WHOLE):
        again = ledger.decide(sent, sub(fp, "A3"), T0 + 700, S)
        assert isinstance(again, Answer) and again.decision is Decision.DUPLICATE, (fp, again)
    # Any other recipients with this key are a reused key, as before.
    other = ledger.decide(sent, sub(ELSE, "A4"), T0 + 700, S)
    assert isinstance(other, Answer) and other.decision is Decision.REUSED


def test_the_rest_held_again_in_part_owes_what_is_left() -> None:
    done = first_delivered()
    verdict = ledger.decide(done, sub(REST, "A2", owed=ELSE), T0 + 600, S)
    assert isinstance(verdict, Proceed) and verdict.record.owed == ELSE
    sent = ledger.settle(verdict.record, "A2", "i-1", DELIVERED, T0 + 601, S)
    last = ledger.decide(sent, sub(ELSE, "A3"), T0 + 900, S)
    assert isinstance(last, Proceed) and last.record.parts == (WHOLE, REST)


def test_the_held_recipients_wait_while_the_accepted_ones_are_not_delivered() -> None:
    verdict = ledger.decide(None, sub(WHOLE, "A1", owed=REST), T0, S)
    assert isinstance(verdict, Proceed)
    in_flight = verdict.record
    deferred = ledger.settle(in_flight, "A1", "i-1", DEFERRED, T0 + 1, S)
    failed = ledger.settle(in_flight, "A1", "i-1", FAILED, T0 + 1, S)
    # Sent now, the held ones would go and the accepted ones' retry (the whole transaction,
    # which the record's fingerprint is) would leave them out, or send them twice.
    for held in (in_flight, deferred):
        wait = ledger.decide(held, sub(REST, "A2"), T0 + 2, S)
        assert isinstance(wait, Answer) and wait.reply.code == 451, (held.state, wait)
    refused = ledger.decide(failed, sub(REST, "A2"), T0 + 2, S)
    assert isinstance(refused, Answer) and refused.reply.code == 550
    # The whole transaction retried after its deferral is the same event, as before.
    retried = ledger.decide(deferred, sub(WHOLE, "A3", owed=None), T0 + 120, S)
    assert isinstance(retried, Proceed) and retried.record.owed is None


def test_an_event_none_of_whose_recipients_was_held_owes_nothing() -> None:
    verdict = ledger.decide(None, sub(WHOLE, "A1"), T0, S)
    assert isinstance(verdict, Proceed)
    done = ledger.settle(verdict.record, "A1", "i-1", DELIVERED, T0 + 1, S)
    assert done.owed is None and "owed" not in done.to_dict()
    other = ledger.decide(done, sub(REST, "A2"), T0 + 600, S)
    assert isinstance(other, Answer) and other.decision is Decision.REUSED
    # Kept by every store as the dict round trip.
    kept = replace(done, owed=REST, parts=(WHOLE,))
    assert Record.from_dict(kept.to_dict()) == kept


def test_the_rest_of_an_event_is_not_settled_by_the_acceptance_of_its_first_part() -> None:
    """The rest's outcome lost after its dot (unknown): the provider's log and its webhooks
    hold the first transaction's acceptance under the same tag and Message-ID, which would
    settle the rest `delivered` though its recipients may never have had it."""
    done = first_delivered()
    verdict = ledger.decide(done, sub(REST, "A2"), T0 + 300, S)
    assert isinstance(verdict, Proceed)
    lost = ledger.settle(verdict.record, "A2", "i-1", UNKNOWN, T0 + 301, S)
    assert lost.state is State.UNKNOWN and lost.parts == (WHOLE,)
    assert attempt_of(lost, "acme:k1") is None  # nothing the log says can be told apart
    first_part = Match(keys=("acme:k1",), message_ids=("<m@app>",), upstream_ids=("Q1",), sg_ids=("A1",))
    assert not names_the_message(lost, first_part)
    assert names_the_message(lost, Match(sg_ids=("A2",)))  # the rest's own attempt id
    # An event with no parts is matched as before.
    assert attempt_of(done, "acme:k1") is not None
