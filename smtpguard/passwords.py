"""Password hashes for zone users: argon2id (RFC 9106), verified off the event loop.

A verification costs tens of milliseconds by design. Legacy apps often open a new
connection and AUTH per message, so successful verifications are cached per process, keyed
by an HMAC of the password under a random per-process key (as Dovecot's auth cache does):
the cache never holds a password or anything that can be tested offline without that key.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

_hasher = PasswordHasher()


# Verified when the user does not exist, so a bad username costs what a bad password costs.
# A constant with the hasher's default parameters (of a random password nobody kept):
# hashing one at import would cost every process start tens of milliseconds.
_DUMMY_HASH = (
    "$argon2id$v=19$m=65536,t=3,p=4$P2IKb8z1nFjreUcoemOwbg$dr1t8irqQYJd26CS0dcHOKmFvNWwSP/IYFmS9bzXzUk"
)


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def _verify_blocking(password_hash: str | None, password: str) -> bool:
    try:
        return _hasher.verify(password_hash or _DUMMY_HASH, password) and password_hash is not None
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def _verify_any_blocking(password_hashes: Sequence[str], password: str, pad_to: int) -> str | None:
    """The first hash the password matches; None when there is none, after at least
    `pad_to` verifications (dummies make up the count), so that a failure costs the same
    for an unknown user, a user with one hash and a user holding several."""
    for h in password_hashes:
        if _verify_blocking(h, password):
            return h
    for _ in range(max(pad_to, 1) - len(password_hashes)):
        _verify_blocking(None, password)
    return None


class Verifier:
    def __init__(self, cache_ttl: float = 300.0) -> None:
        self._key = secrets.token_bytes(32)
        self._ttl = cache_ttl
        self._cache: dict[tuple[str, str], tuple[bytes, float]] = {}

    def _tag(self, username: str, password: str) -> bytes:
        return hmac.new(self._key, f"{username}\x00{password}".encode(), hashlib.sha256).digest()

    async def verify(self, username: str, password_hash: str | None, password: str) -> bool:
        now = time.monotonic()
        tag = self._tag(username, password)
        if password_hash is not None:
            cached = self._cache.get((username, password_hash))
            if cached and cached[1] > now and hmac.compare_digest(cached[0], tag):
                return True
        ok = await asyncio.to_thread(_verify_blocking, password_hash, password)
        if ok and password_hash is not None:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[(username, password_hash)] = (tag, now + self._ttl)
        return ok

    async def verify_any(
        self, username: str, password_hashes: Sequence[str], password: str, pad_to: int = 1
    ) -> str | None:
        """The hash the password matches, None when none does. A user holds several during
        a rotation (`password_hashes: [new, old]`), all verified in one trip off the event
        loop. A wrong password costs as many verifications as the most hashes any user holds
        (`pad_to`), whoever the user, an unknown one included: the time of a failure says
        nothing about the username. The session keeps the hash it matched: a reload that
        drops it (the end of a rotation) ends what that password may still do."""
        if len(password_hashes) == 1 and pad_to <= 1:
            ok = await self.verify(username, password_hashes[0], password)
            return password_hashes[0] if ok else None
        now = time.monotonic()
        tag = self._tag(username, password)
        for h in password_hashes:
            cached = self._cache.get((username, h))
            if cached and cached[1] > now and hmac.compare_digest(cached[0], tag):
                return h
        matched = await asyncio.to_thread(_verify_any_blocking, tuple(password_hashes), password, pad_to)
        if matched is not None:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[(username, matched)] = (tag, now + self._ttl)
        return matched
