"""Console sessions, kept in the console's process.

A session is a random token in an HttpOnly, SameSite=Strict cookie (Secure under TLS) and
a CSRF token of its own that every POST must carry in its form. A login gets a new session
(the one the login form was served in is dropped, so a planted token never becomes a
logged-in one). Nothing in a session can be forged or tested offline: both tokens are
`secrets.token_urlsafe(32)` and are compared in constant time.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

COOKIE = "sg_console"
LOGIN_COOKIE = "sg_login"
"""The login form's CSRF token (double submit): no server-side session before a login."""
MAX_SESSIONS = 10_000


@dataclass
class Session:
    token: str
    csrf: str
    expires: float
    username: str | None = None
    role: str | None = None

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(self.csrf, given)


class Sessions:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.clock = clock
        self._by_token: dict[str, Session] = {}

    def new(self, username: str | None = None, role: str | None = None) -> Session:
        now = self.clock()
        if len(self._by_token) >= MAX_SESSIONS:
            self._by_token = {t: s for t, s in self._by_token.items() if s.expires > now}
            while len(self._by_token) >= MAX_SESSIONS:
                self._by_token.pop(next(iter(self._by_token)))
        # A session nobody logged in with lives only as long as a login form needs.
        ttl = self.ttl if username is not None else min(self.ttl, 3600.0)
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), now + ttl, username, role)
        self._by_token[session.token] = session
        return session

    def get(self, token: str | None) -> Session | None:
        if not token:
            return None
        session = self._by_token.get(token)
        if session is None:
            return None
        if session.expires <= self.clock():
            del self._by_token[token]
            return None
        return session

    def drop(self, token: str) -> None:
        self._by_token.pop(token, None)
