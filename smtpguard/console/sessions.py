"""Console sessions, kept in the console's process.

A session is a random token in an HttpOnly, SameSite=Strict cookie (Secure under TLS) and
a CSRF token of its own that every POST must carry in its form. There is no session before
a login: a login always makes a new one (so a token planted in a browser never becomes a
logged-in one) and ends every earlier session of that operator and the one the browser
presented. A session holds a fingerprint of the password hash it was opened with: when a
reload changes the hash, or removes or demotes the operator, the session is over. Nothing
in a session can be forged or tested offline: both tokens are `secrets.token_urlsafe(32)`
and are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

COOKIE = "sg_console"
LOGIN_COOKIE = "sg_login"
"""The login form's CSRF token (double submit): no server-side session before a login."""
MAX_SESSIONS = 10_000


def same_token(expected: str, given: str) -> bool:
    """Constant-time equality of a token we issued and one a request carries, compared as
    bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500 and a
    logged traceback for any stranger's form), and no token we issue has any."""
    return hmac.compare_digest(_octets(expected), _octets(given))


def _octets(token: str) -> bytes:
    # surrogatepass: a header or form value decoded with surrogateescape still encodes.
    return token.encode("utf-8", "surrogatepass")


def fingerprint(password_hash: str) -> str:
    """What a session remembers of the hash it was opened with (not the hash itself)."""
    return hashlib.sha256(password_hash.encode()).hexdigest()


@dataclass
class Session:
    token: str
    csrf: str
    started: float
    username: str
    role: str
    credential: str
    """fingerprint() of the operator's password hash at login."""

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and same_token(self.csrf, given)


class Sessions:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        """Read at every lookup: a reload that shortens session_ttl shortens open sessions too."""
        self.clock = clock
        self._by_token: dict[str, Session] = {}

    def new(self, username: str, role: str, credential: str) -> Session:
        """A fresh session for a login; the operator's earlier sessions end."""
        self.end(lambda s: s.username == username)
        now = self.clock()
        if len(self._by_token) >= MAX_SESSIONS:
            self.end(lambda s: s.started + self.ttl <= now)
            while len(self._by_token) >= MAX_SESSIONS:
                self._by_token.pop(next(iter(self._by_token)))
        token = secrets.token_urlsafe(32)
        session = Session(token, secrets.token_urlsafe(32), now, username, role, credential)
        self._by_token[token] = session
        return session

    def get(self, token: str | None) -> Session | None:
        if not token:
            return None
        session = self._by_token.get(token)
        if session is None:
            return None
        if session.started + self.ttl <= self.clock():
            del self._by_token[token]
            return None
        return session

    def drop(self, token: str | None) -> None:
        if token:
            self._by_token.pop(token, None)

    def end(self, over: Callable[[Session], bool]) -> list[Session]:
        """End every session `over` says is over; the ones ended."""
        ended = [s for s in self._by_token.values() if over(s)]
        for s in ended:
            del self._by_token[s.token]
        return ended

    def __len__(self) -> int:
        return len(self._by_token)
