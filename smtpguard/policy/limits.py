"""Plans, caps and their windows (DESIGN.md §5).

The store counts atomically; this module says what the limits are, which window a moment
falls in, and what the client is told when a cap is reached.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Literal, Protocol

from smtpguard import replies
from smtpguard.policy.decisions import Decision
from smtpguard.policy.outcome import Kind, Outcome
from smtpguard.replies import Reply

PlanName = Literal["free", "solo", "starter", "business", "agency", "unlimited"]
HOUR = 3600.0
WINDOW_KEEP = 2 * HOUR
"""How long every store keeps a window's entries: longer than any window that reads them
(the hourly caps, AUTH lockouts)."""


@dataclass(frozen=True, slots=True)
class Caps:
    hourly: int
    monthly: int

    def with_own(self, hourly: int | None, monthly: int | None) -> Caps:
        """These caps with each window that sets its own cap (a zone inside its plan's, a
        user inside its zone's) taking that one; None keeps this one."""
        return Caps(
            hourly=self.hourly if hourly is None else hourly,
            monthly=self.monthly if monthly is None else monthly,
        )


@dataclass(frozen=True, slots=True)
class Plan:
    send_as: bool
    caps: Caps


PLANS: dict[str, Plan] = {
    "free": Plan(send_as=False, caps=Caps(hourly=0, monthly=0)),
    "solo": Plan(send_as=True, caps=Caps(hourly=20, monthly=2_500)),
    "starter": Plan(send_as=True, caps=Caps(hourly=40, monthly=5_000)),
    "business": Plan(send_as=True, caps=Caps(hourly=60, monthly=12_000)),
    "agency": Plan(send_as=True, caps=Caps(hourly=60, monthly=20_000)),
    "unlimited": Plan(send_as=True, caps=Caps(hourly=300, monthly=100_000)),
}


@dataclass(frozen=True, slots=True)
class CapCheck:
    """What the store needs to count and consume one unit atomically."""

    zone: str
    caps: Caps
    hour_start: float
    """Sends at or after this instant are in the sliding 60-minute window."""
    month: str
    """Calendar month (UTC) the unit is counted in, `YYYY-MM`."""
    token: str
    """Identifies the unit, so it can be refunded when nothing reached a provider."""
    now: float
    user: str | None = None
    """The SMTP user whose own caps (DESIGN.md §16) the unit also counts under, when the
    user has any: one unit of the zone's and one of the user's, taken together or not at
    all, and refunded together by the token alone."""
    user_caps: Caps | None = None


@dataclass(frozen=True, slots=True)
class CapReached:
    window: Literal["hour", "month"]
    cap: int
    free_at: float | None = None
    """Hourly only: when the oldest send in the window leaves it."""
    user: str | None = None
    """Set when the SMTP user's own cap refused, not the zone's."""


def caps_for(plan: str, hourly: int | None, monthly: int | None) -> Caps:
    return PLANS[plan].caps.with_own(hourly, monthly)


_month_span: tuple[float, float, str] = (0.0, 0.0, "")
"""The last month asked for: [start, end) in epoch seconds and its name."""


def month_of(now: float) -> str:
    """Calendar month (UTC) of `now`, `YYYY-MM`. Asked several times per message, so the
    month last seen is kept with its bounds (formatting a date each time cost more)."""
    global _month_span
    start, end, name = _month_span
    if start <= now < end:
        return name
    day = datetime.fromtimestamp(now, UTC)
    first = datetime(day.year, day.month, 1, tzinfo=UTC)
    following = datetime(day.year + day.month // 12, day.month % 12 + 1, 1, tzinfo=UTC)
    _month_span = (first.timestamp(), following.timestamp(), first.strftime("%Y-%m"))
    return _month_span[2]


def token_time(token: str) -> float | None:
    """When an attempt id (smtpguard's cap token) was made: its first 11 hex digits are
    milliseconds since the epoch (ids.new_id)."""
    if len(token) < 11:
        return None
    try:
        return int(token[:11], 16) / 1000
    except ValueError:
        return None


def token_month(token: str, fallback: float) -> str:
    """The month a token's unit is counted in: decided by the token alone, so whoever
    refunds it later (another instance, after a crash) names the same month."""
    at = token_time(token)
    return month_of(fallback if at is None else at)


def user_caps_for(zone: Caps, hourly: int | None, monthly: int | None) -> Caps | None:
    """A user's own caps inside the zone's (DESIGN.md §16): None when the user has none
    (nothing is counted per user); a window the user sets no cap for is bounded by the
    zone's anyway, so it takes the zone's."""
    if hourly is None and monthly is None:
        return None
    return zone.with_own(hourly, monthly)


class OwnCaps(Protocol):
    """A zone or one of its SMTP users as far as its own caps go: a window it sets None for
    takes the plan's (a zone's) or the zone's (a user's)."""

    @property
    def hourly_cap(self) -> int | None: ...
    @property
    def monthly_cap(self) -> int | None: ...


class UserLimits(OwnCaps, Protocol):
    """A zone's SMTP user as far as caps go (config's UserConfig has this shape)."""

    @property
    def username(self) -> str: ...


def user_caps_of(users: Iterable[UserLimits], username: str | None, caps: Caps) -> Caps | None:
    """The SMTP user's own caps inside the zone's (DESIGN.md §16), None when it has none."""
    if username is None:
        return None
    for user in users:
        if user.username == username:
            return user_caps_for(caps, user.hourly_cap, user.monthly_cap)
    return None


def cap_check(
    zone: str, caps: Caps, token: str, now: float, user: str | None = None, user_caps: Caps | None = None
) -> CapCheck:
    if user_caps is None:
        user = None
    return CapCheck(zone, caps, now - HOUR, token_month(token, now), token, now, user, user_caps)


def hour_free_at(oldest_in_window: float | None, now: float) -> float:
    return (oldest_in_window if oldest_in_window is not None else now) + HOUR


def cap_reply(zone: str, reached: CapReached) -> Reply:
    if reached.window == "month":
        return replies.monthly_cap(zone, reached.cap, reached.user)
    return replies.hourly_cap(zone, reached.cap, reached.free_at or 0.0, reached.user)


def cap_decision(reached: CapReached) -> Decision:
    """The decision (stats, metrics) a cap refusal is counted as."""
    return Decision(f"user_cap_{reached.window}" if reached.user is not None else f"cap_{reached.window}")


class Ending(Enum):
    """How an attempt's reservation or relay ended, as far as its cap unit goes."""

    RESERVED = "reserved"
    """The reservation stands (also when only its reply was lost and the write is ours)."""
    RESERVE_UNANSWERED = "reserve_unanswered"
    """The store failed during the write that takes the attempt's unit (relay mode's
    reservation, or a queued entry's consume_cap at delivery): it may have run with only its
    reply lost."""
    LEASE_LOST = "lease_lost"
    """Another submission took the key over before DATA."""
    STORE_LOST = "store_lost"
    """The store failed before DATA (the data_sent note or a renewal)."""
    HELD = "held"
    """Queued mail given back unsent while every provider of the route is throttled."""
    EXPIRED = "expired"
    """Queued mail whose class's max_age ran out after its claim, before DATA."""
    RELAYED = "relayed"
    """The route answered with an outcome."""


def unit_fate(
    ending: Ending,
    attempt: str,
    taken_over: Sequence[str] = (),
    outcome: Outcome | None = None,
    counted: bool = True,
) -> tuple[str, ...]:
    """The cap tokens to refund once an attempt ends (DESIGN.md §5, §11.3): a unit is spent
    once anything may have reached a provider's DATA, and given back when nothing can have.

    `taken_over` are the tokens of earlier attempts a standing reservation replaced (the
    ledger's verdict names them); `counted` says whether the reservation took a unit at all
    (store-and-forward acceptance does not: caps are counted at delivery)."""
    if ending is Ending.RESERVED:
        return tuple(taken_over)
    if ending is Ending.RESERVE_UNANSWERED:
        # If the write stands anyway, the submission that takes the record over after its
        # lease refunds the same token again: a no-op.
        return (attempt,) if counted else ()
    if ending is Ending.RELAYED:
        assert outcome is not None, "a relayed attempt has an outcome"
        # Nothing reached a provider's DATA: unavailable, or refused at MAIL or RCPT.
        spent = outcome.kind is not Kind.UNAVAILABLE and outcome.data_sent is not False
        return () if spent else (attempt,)
    # Lease lost, store lost, held for a throttle, expired: stopped before any DATA.
    return (attempt,)
