"""policy.verdict_records: what a verdict does to a record (DESIGN.md §19), pure."""

from __future__ import annotations

from smtpguard.policy.eventkey import message_id_for
from smtpguard.policy.events import Match
from smtpguard.policy.record import Attempt, Phase, Record, State
from smtpguard.policy.verdict_records import attempt_of, names_the_message, settled_record
from smtpguard.policy.verdicts import (
    WINDOW,
    LogEntry,
    LogKind,
    Verdict,
    VerdictKind,
    ingested_past,
    matches,
    verdict,
    window,
)

T0 = 1_900_000_000.0


def unknown(lost_until: float | None = None) -> Record:
    lost = Attempt("sg1:lost", T0, "a", "primary", Phase.DATA_SENT.value, "unknown", message_id="<m@x>")
    return Record(
        zone="acme", key="k", state=State.UNKNOWN, fingerprint="f", created_at=T0 - 5,
        updated_at=T0, version=3, sg_id="sg1", via="primary", message_id="<m@x>",
        lost_owner="a" if lost_until else None, lost_until=lost_until, attempts=(lost,),
    )  # fmt: skip


def test_the_attempt_asked_about_is_the_lost_one_through_its_provider() -> None:
    a = attempt_of(unknown(), "acme:k")
    assert a is not None and (a.provider, a.at, a.tag, a.message_id) == ("primary", T0, "acme:k", "<m@x>")


def settle(rec: Record, verdict: Verdict, now: float) -> Record | None:
    return settled_record(rec, verdict, "api primary", "verdict:primary", now, T0)


def test_not_accepted_waits_while_the_owner_may_still_be_in_data_the_rest_does_not() -> None:
    rec = unknown(lost_until=T0 + 100)
    assert settle(rec, Verdict(VerdictKind.NOT_ACCEPTED), T0 + 50) is None
    later = settle(rec, Verdict(VerdictKind.NOT_ACCEPTED), T0 + 101)
    assert later is not None and later.state is State.DEFERRED and later.next_attempt_at == T0 + 101
    assert later.lost_until is None and later.version == 4
    taken = settle(rec, Verdict(VerdictKind.ACCEPTED, "up-9"), T0 + 50)
    assert taken is not None and taken.state is State.DELIVERED and taken.upstream_id == "up-9"
    assert taken.audit[-1].note == "verdict accepted via api primary; upstream id up-9"


def test_only_an_unknown_record_and_only_a_settling_verdict() -> None:
    rec = unknown()
    for kind in (VerdictKind.NONE_YET, VerdictKind.GAVE_UP):
        assert settle(rec, Verdict(kind), T0) is None
    for state in State:
        if state is not State.UNKNOWN:
            other = Record(**{**rec.to_dict(), "state": state.value, "attempts": [], "audit": []})  # type: ignore[arg-type]
            assert settle(other, Verdict(VerdictKind.ACCEPTED), T0) is None


def test_a_lost_lease_is_asked_about_until_its_owner_could_have_sent() -> None:
    """The owner may have been in DATA until lost_until: its copy logged then still matches,
    and only an acceptance after it proves the log has ingested past the attempt."""
    a = attempt_of(unknown(lost_until=T0 + 3600), "acme:k")
    assert a is not None and (a.at, a.latest) == (T0, T0 + 3600)
    assert window(a) == (T0 - WINDOW, T0 + 3600 + WINDOW)
    ours = LogEntry("primary", LogKind.ACCEPTED, T0 + 3000, tag="acme:k")
    assert matches(a, ours)
    other_before = LogEntry("primary", LogKind.ACCEPTED, T0 + 1800, tag="acme:other")
    other_after = LogEntry("primary", LogKind.ACCEPTED, T0 + 3601, tag="acme:other")
    assert not ingested_past(a, [other_before]) and ingested_past(a, [other_after])
    v = verdict(
        a, [], now=T0 + 3600 + 1799, absent_after=1800, give_up=86400, proof_of_ingestion=True, log="mailgun"
    )
    assert v.kind is VerdictKind.NONE_YET  # absent_after counts from lost_until


def test_an_acceptance_names_the_message_by_an_id_that_is_the_records_alone() -> None:
    rec = unknown()
    own = message_id_for("acme", "k", "mail.acme.example")
    assert names_the_message(rec, Match(keys=("acme:k",), message_ids=("<m@x>",)))
    assert names_the_message(rec, Match(sg_ids=("sg1",)))
    assert names_the_message(rec, Match(message_ids=(own.upper(),)))
    # The application's own Message-ID, which it may reuse under another key; another tag.
    assert not names_the_message(rec, Match(message_ids=("<m@x>",)))
    assert not names_the_message(rec, Match(keys=("acme:other",), message_ids=(own,)))
