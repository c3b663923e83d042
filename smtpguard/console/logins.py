"""Failed console logins, limited per client address *and* per username (DESIGN.md §18).

The counts are the store's AUTH failure windows, the limiter SMTP AUTH uses, in buckets of
the console's own: an operator's typos must not lock the SMTP clients of the same address
(the console is usually on loopback, as they are) out of AUTH. Per address alone, guesses
from many addresses would never be counted against the account; per username alone, one
address could try every name (an IPv6 client is counted by its /64, all of which it
holds). Either count at `limits.auth_failures` refuses the login.

An attempt is counted as a failure *before* its password is tested, and a success is
counted beside it (`…:ok`), so failures are attempts less successes. Counting after the
test let a store that answers reads but refuses writes (a demoted primary, a full
noeviction Redis) turn every wrong guess into an uncounted 503 while the right password
still logged in: now a login that cannot be counted is never tried.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable

from smtpguard.config import LimitsConfig
from smtpguard.policy import http_trust
from smtpguard.store import Store
from smtpguard.turns import Turns

MAX_USERNAME = 64
"""The longest username an operator can have: a longer one typed is counted by this prefix."""
_OK = "ok:"
"""The prefix of a bucket's successes."""
_WHICH = ("address", "username")


class LoginLimiter:
    def __init__(self, store: Store, limits: Callable[[], LimitsConfig]) -> None:
        self.store = store
        self.limits = limits
        self._turns = Turns()

    @staticmethod
    def buckets(address: str, username: str) -> tuple[str, str]:
        # Escaped as JSON, ASCII only: a NUL (PostgreSQL's text refuses it) or any control
        # character typed as a username still makes a key every store takes, and readable.
        typed = json.dumps(username[:MAX_USERNAME])[1:-1]
        return f"console:{http_trust.limit_unit(address)}", f"console-user:{typed}"

    @contextlib.asynccontextmanager
    async def turn(self, address: str, username: str) -> AsyncIterator[None]:
        """One login at a time per address and per username in this process: the count
        stays exact where the store's is not atomic (PostgreSQL), and a burst of guesses
        spends no writes past the limit. The address lock is always taken first, so two
        logins never wait for each other's second lock."""
        by_address, by_user = self.buckets(address, username)
        async with self._turns.turn(by_address), self._turns.turn(by_user):
            yield

    async def refused(self, address: str, username: str, now: float) -> str | None:
        """Which count is full, if one is."""
        limit, window = self.limits().auth_failures, self.limits().auth_failure_window
        for which, bucket in zip(_WHICH, self.buckets(address, username), strict=True):
            attempts = await self.store.auth_failures(bucket, now, window)
            if await self._failures(bucket, attempts, now) >= limit:
                return which
        return None

    async def attempt(self, address: str, username: str, now: float) -> str | None:
        """Count an attempt as failed before its password is tested (StoreUnavailable: it
        must not be tested). The count the store returns includes what other instances
        counted meanwhile (turn() serialises this process only): over the limit, the
        attempt is taken back and refused, and which count it went over is returned."""
        limit, window = self.limits().auth_failures, self.limits().auth_failure_window
        over = None
        for which, bucket in zip(_WHICH, self.buckets(address, username), strict=True):
            attempts = await self.store.auth_failure(bucket, now, window)
            if over is None and await self._failures(bucket, attempts, now) > limit:
                over = which
        if over is not None:
            await self.take_back(address, username, now)
        return over

    async def _failures(self, bucket: str, attempts: int, now: float) -> int:
        # The successes are read whatever the attempts: an operator who logs in often must
        # not make their username answer a round trip slower than a name nobody has.
        return attempts - await self.store.auth_failures(_OK + bucket, now, self.limits().auth_failure_window)

    async def take_back(self, address: str, username: str, now: float) -> None:
        """Undo what attempt() counted (a success, or an attempt refused): the same `now`,
        so both leave the window together."""
        window = self.limits().auth_failure_window
        for bucket in self.buckets(address, username):
            await self.store.auth_failure(_OK + bucket, now, window)
