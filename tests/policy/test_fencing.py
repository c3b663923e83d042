"""policy/fencing.py: which writable server of a multi-host URL is written (DESIGN.md §18)."""

from __future__ import annotations

from smtpguard.policy.fencing import Member, choose

A = Member("10.0.0.1:5432", "7001", 1)
B = Member("10.0.0.2:5432", "7001", 2)


def test_one_writable_server_or_none_leaves_the_choice_to_libpq() -> None:
    assert choose([]).write_to is None and not choose([]).refuse
    assert choose([A]).write_to is None and not choose([A]).refuse


def test_of_two_writable_servers_the_newer_timeline_is_written_and_the_other_fenced() -> None:
    for order in ([A, B], [B, A]):
        choice = choose(order)
        assert choice.write_to == B and not choice.refuse
        assert choice.fenced == (A,)
        assert "10.0.0.1:5432 (timeline 1) fenced" in choice.reason


def test_equal_timelines_are_written_to_neither() -> None:
    twin = Member("10.0.0.3:5432", "7001", 2)
    choice = choose([A, B, twin])
    assert choice.refuse and choice.write_to is None
    assert set(choice.fenced) == {A, B, twin}
    assert "same timeline 2" in choice.reason


def test_servers_of_two_clusters_are_written_to_neither_whatever_their_timelines() -> None:
    other = Member("10.0.0.3:5432", "9999", 7)
    choice = choose([B, other])
    assert choice.refuse and choice.write_to is None
    assert "different clusters" in choice.reason
