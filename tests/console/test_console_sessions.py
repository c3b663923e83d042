"""console/sessions.py on a clock of its own: a login ends the operator's earlier sessions,
a shortened session_ttl (a reload) shortens open sessions, `end` reports what it ended."""

from __future__ import annotations

from smtpguard.console.sessions import Sessions, fingerprint


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_login_ends_the_same_operators_earlier_sessions_only() -> None:
    sessions = Sessions(3600, Clock())
    first = sessions.new("alice", "operator", fingerprint("h1"))
    bobs = sessions.new("bob", "viewer", fingerprint("h2"))
    second = sessions.new("alice", "operator", fingerprint("h1"))
    assert second.token != first.token and second.csrf != first.csrf
    assert sessions.get(first.token) is None
    assert sessions.get(second.token) is second and sessions.get(bobs.token) is bobs
    assert len(sessions) == 2


def test_a_shorter_ttl_shortens_open_sessions() -> None:
    clock = Clock()
    sessions = Sessions(8 * 3600, clock)
    s = sessions.new("alice", "operator", fingerprint("h1"))
    clock.now += 2 * 3600
    assert sessions.get(s.token) is s
    sessions.ttl = 3600
    assert sessions.get(s.token) is None and len(sessions) == 0


def test_end_returns_the_sessions_it_ended() -> None:
    sessions = Sessions(3600, Clock())
    a = sessions.new("alice", "operator", fingerprint("h1"))
    b = sessions.new("bob", "operator", fingerprint("h2"))
    assert sessions.end(lambda s: s.credential == fingerprint("h2")) == [b]
    assert sessions.get(a.token) is a and sessions.get(b.token) is None
    assert fingerprint("h1") != "h1" and len(fingerprint("h1")) == 64
