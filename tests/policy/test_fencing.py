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


def test_an_older_timeline_seen_before_a_newer_one_is_never_written_again() -> None:
    first = choose([A, B])
    assert first.write_to == B and first.newest == B
    # The promoted server is away: the old primary alone accepts writes, and is refused.
    alone = choose([A], first.newest)
    assert alone.refuse and alone.write_to is None and alone.fenced == (A,)
    assert "older timeline than 2" in alone.reason and alone.newest == B
    # Back: written again, the old one still fenced.
    back = choose([A, B], alone.newest)
    assert back.write_to == B and back.fenced == (A,) and not back.refuse


def test_a_newer_timeline_than_seen_moves_what_is_remembered() -> None:
    c = Member("10.0.0.3:5432", "7001", 3)
    one = choose([B])
    assert one.write_to is None and not one.refuse and one.newest == B
    # B alone again after C was promoted: B is on an older timeline now.
    later = choose([B, c], one.newest)
    assert later.write_to == c and later.newest == c
    assert choose([B], later.newest).refuse
    # A server of another cluster is not compared with this one's timelines (as before).
    other = Member("10.0.0.9:5432", "9999", 1)
    assert not choose([other], later.newest).refuse


def test_a_server_of_the_newest_timeline_alone_with_an_older_one_is_pinned() -> None:
    # Only B's timeline is current, but A also accepts writes: libpq could take A.
    choice = choose([A, B], B)
    assert choice.write_to == B and choice.fenced == (A,)
