"""policy.sends: whether a provider's event about a record is put off ("retry later") or
applied, decided on the record and the clock alone (DESIGN.md §18)."""

from __future__ import annotations

from dataclasses import replace

from smtpguard.policy.ledger import Attempt, Phase, Record, State
from smtpguard.policy.sends import in_flight_through, sent_as, sent_through

NOW = 1_800_000_000.0


def _sending(**changes: object) -> Record:
    rec = Record(
        zone="acme",
        key="invoice:1",
        fingerprint="f",
        state=State.IN_FLIGHT,
        sg_id="ab12",
        version=3,
        created_at=NOW - 10,
        updated_at=NOW - 1,
        owner="a",
        lease_until=NOW + 5,
        phase=Phase.DATA_SENT,
        via="primary",
    )
    return replace(rec, **changes)  # type: ignore[arg-type]


def test_a_send_under_a_live_lease_is_in_flight_through_its_provider_only() -> None:
    rec = _sending()
    assert in_flight_through(rec, "primary", NOW)
    assert not in_flight_through(rec, "standby", NOW)
    assert sent_through(rec, "primary") and not sent_through(rec, "standby")


def test_a_send_whose_lease_is_over_is_no_longer_in_flight_but_still_sent_through() -> None:
    rec = _sending()
    assert not in_flight_through(rec, "primary", NOW + 5)
    assert not in_flight_through(rec, "primary", NOW + 86_400)
    assert not in_flight_through(replace(rec, lease_until=None), "primary", NOW)
    assert sent_through(rec, "primary")


def test_before_data_or_with_the_outcome_written_it_is_not_in_flight() -> None:
    assert not in_flight_through(_sending(phase=Phase.BEFORE_DATA), "primary", NOW)
    done = Attempt("ab12", NOW, "a", "primary", "data_sent", "sent", "250 ok")
    assert not in_flight_through(_sending(attempts=(done,)), "primary", NOW)


def test_a_record_was_sent_as_its_current_and_its_earlier_attempts_only() -> None:
    earlier = Attempt("0a01", NOW - 60, "a", "primary", "data_sent", "delivered", "250 ok")
    rec = _sending(attempts=(earlier,))
    assert sent_as(rec, "ab12") and sent_as(rec, "0a01")
    assert not sent_as(rec, "0a02") and not sent_as(rec, "0a01:lost")
