"""The relay's failover table, as pure decisions (DESIGN.md §6, §11.6, §16).

Everything that decides what a provider's answer means for the event, and whether the route
may try the next provider, lives here; relay/ gathers the answers and carries this out.

The one rule: failover only while nothing can have been accepted, never after the final
dot. An answer becomes an Attempted — the Outcome (policy/outcome.py) plus whether the next
provider may be tried, and what the answer says about this provider's health (for its
circuit breaker, policy/breaker.py). A rate limit (policy/throttle.py) is the provider
asking for less traffic: it throttles the provider and does not count against its circuit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from smtpguard import replies
from smtpguard.policy.breaker import Breaker
from smtpguard.policy.outcome import Kind, Outcome, classify_reply, queue_id, upstream_reply
from smtpguard.policy.throttle import is_rate_limit
from smtpguard.replies import Reply

Health = Literal["ok", "fail", "trip"]


@dataclass(frozen=True, slots=True)
class Attempted:
    outcome: Outcome
    failover: bool
    """True only when the failure came before the message could have been accepted."""
    health: Health
    rate_limited: bool = False
    """The provider answered with a rate limit (policy/throttle.py): the route throttles it
    fleet-wide, and its circuit does not count it (health is "ok")."""
    busy: bool = False
    """No max_connections slot came free in time: nothing was tried."""


# --- one provider's answer, by how far the transaction got -----------------------------------
def auth_refused(provider: str, code: int, text: str) -> Attempted:
    """AUTH refused (after any retry with another secret). A 535 is smtpguard's credentials:
    the circuit opens at once ("trip"), though the next provider may still be tried."""
    reply = upstream_reply(code, text)
    if is_rate_limit(code, reply.enhanced, text):
        return rate_limited(provider, reply)
    if code != 535:
        return unavailable(provider, f"upstream AUTH: {code} {text[:100]}")
    return Attempted(
        Outcome(
            Kind.UNAVAILABLE,
            provider,
            upstream_reply(code, text),
            detail="upstream AUTH refused",
            data_sent=False,
        ),
        failover=True,
        health="trip",
    )


def smtputf8_missing(provider: str) -> Attempted:
    """The message needs SMTPUTF8 and this provider does not offer it. RFC 6531's 553 5.6.7,
    but this provider's alone — nothing was sent, so the route may fail over to one that
    offers SMTPUTF8; where none does, the event fails with the 553. The provider is healthy."""
    return Attempted(
        Outcome(Kind.FAILED, provider, replies.smtputf8_not_offered(provider), data_sent=False),
        failover=True,
        health="ok",
    )


def eightbitmime_missing(provider: str) -> Attempted:
    """The message has 8-bit data and this provider offers neither 8BITMIME nor SMTPUTF8
    (RFC 6152 §3). As smtputf8_missing: nothing was sent, so the route may fail over to a
    provider that offers it; where none does, the event fails with 554 5.6.3."""
    return Attempted(
        Outcome(Kind.FAILED, provider, replies.eightbitmime_not_offered(provider), data_sent=False),
        failover=True,
        health="ok",
    )


def refused_all(provider: str, rejected: list[tuple[str, Reply]]) -> Attempted:
    temp = next((r for _, r in rejected if r.temporary), None)
    if temp is not None and is_rate_limit(temp.code, temp.enhanced, temp.text):
        return rate_limited(provider, temp)
    if temp is not None:
        return Attempted(
            Outcome(Kind.DEFERRED, provider, temp, rejected=tuple(rejected), data_sent=False),
            failover=True,
            health="fail" if temp.code == 421 else "ok",
        )
    first = rejected[0][1]
    return Attempted(
        Outcome(Kind.FAILED, provider, first, rejected=tuple(rejected), data_sent=False),
        failover=False,
        health="ok",
    )


def before_dot_reply(provider: str, code: int, text: str) -> Attempted:
    reply = upstream_reply(code, text)
    if is_rate_limit(code, reply.enhanced, reply.text):
        return rate_limited(provider, reply)
    if reply.temporary:
        return Attempted(
            Outcome(Kind.DEFERRED, provider, reply, data_sent=False),
            failover=True,
            health="fail" if code == 421 else "ok",
        )
    return Attempted(Outcome(Kind.FAILED, provider, reply, data_sent=False), failover=False, health="ok")


def data_reply(
    provider: str,
    code: int,
    text: str,
    rejected: list[tuple[str, Reply]],
    body_written: bool,
    accepted: tuple[str, ...] = (),
) -> Attempted:
    """A refusal during DATA: to the DATA command itself (no byte of the message written),
    or to the message after its final dot."""
    if not body_written:
        # To the DATA command itself: not one byte of the message was written (it goes
        # only after a 354), so nothing can have been accepted. As a reply to MAIL: a
        # try-later may fail over (a primary whose queue cannot take a file answers DATA
        # with 451 to every message), a refusal ends the event, a rate limit throttles.
        before = before_dot_reply(provider, code, text)
        return replace(before, outcome=replace(before.outcome, rejected=tuple(rejected)))
    reply = upstream_reply(code, text)
    limited = is_rate_limit(code, reply.enhanced, reply.text)
    # The provider's answer to the message after its final dot: that reply is the outcome
    # (a 4xx defers, DESIGN.md §4) and it is never failed over; a rate limit still throttles
    # the provider for the messages that follow.
    kind = classify_reply(code)
    health: Health = "ok" if limited else "fail" if code == 421 else "ok"
    # A 2xx other than 250 took the message too: its queue id finds it as a 250's does.
    taken = queue_id(text) if kind is Kind.DELIVERED else None
    return Attempted(
        Outcome(
            kind,
            provider,
            reply,
            upstream_id=taken,
            rejected=tuple(rejected),
            # Taken (a 2xx): for the recipients its RCPTs accepted, as a 250 is.
            accepted=accepted if kind is Kind.DELIVERED else (),
            data_sent=True,
        ),
        failover=False,
        health=health,
        rate_limited=limited,
    )


def lost_at_data(
    provider: str, error: str, rejected: list[tuple[str, Reply]], body_written: bool
) -> Attempted:
    """The connection was lost (or timed out) during DATA."""
    if not body_written:
        # Lost while waiting for 354: not one byte of the message, let alone its final dot,
        # was written, so nothing can have been accepted (DESIGN.md §11.6).
        return unavailable(provider, f"at DATA, before the message: {error}")
    return unknown(provider, error, rejected)


def rate_limited(provider: str, reply: Reply) -> Attempted:
    """A rate limit before the message could have been accepted: nothing was sent, so the
    route may fail over, and the event stays retryable (unavailable, as for an open circuit:
    the client hears 451 4.4.1, never the provider's 421, which would close its session)."""
    return Attempted(
        Outcome(Kind.UNAVAILABLE, provider, reply, detail=f"rate limited: {reply}", data_sent=False),
        failover=True,
        health="ok",
        rate_limited=True,
    )


def connections_busy(provider: str) -> Attempted:
    """Every max_connections slot of the provider is held (by this instance or others)."""
    return Attempted(
        Outcome(
            Kind.UNAVAILABLE, provider, detail="max_connections in use on every instance", data_sent=False
        ),
        failover=True,
        health="ok",
        busy=True,
    )


def unknown(provider: str, error: str, rejected: list[tuple[str, Reply]]) -> Attempted:
    """The message was written and no reply came: RFC 1047's window. The outcome is this
    provider's (never failed over) and nobody knows it."""
    return Attempted(
        Outcome(
            Kind.UNKNOWN,
            provider,
            detail=f"after DATA: {error}",
            rejected=tuple(rejected),
            data_sent=True,
        ),
        failover=False,
        health="fail",
    )


def unavailable(provider: str, detail: str, health: Health = "fail") -> Attempted:
    """Nothing of the message reached the provider: retryable, and the next provider may be
    tried. `health="ok"` when the fault is the message's, not the provider's."""
    return Attempted(
        Outcome(Kind.UNAVAILABLE, provider, detail=detail, data_sent=False), failover=True, health=health
    )


# --- the route's choice ----------------------------------------------------------------------
def retries_same(result: Attempted, idempotent: bool) -> bool:
    """An unknown outcome on a provider that dedupes on our header: one more try on it cannot
    duplicate."""
    return result.outcome.kind is Kind.UNKNOWN and idempotent


def after_retry(first: Attempted, retry: Attempted) -> Attempted:
    """Whatever the retry comes to, the outcome stays this provider's: the first copy may be
    there, so never another provider. Only a 250 settles it; any other answer says nothing
    about the first copy."""
    return retry if retry.outcome.kind is Kind.DELIVERED else replace(first, failover=False)


def health_after(breaker: Breaker, health: Health, now: float) -> Breaker:
    if health == "ok":
        return breaker.success()
    if health == "trip":
        return breaker.trip(now)
    return breaker.failure(now)


def reply_class(outcome: Outcome) -> str:
    """The upstream metric's label: the kind when no reply settles it, else 2xx/4xx/5xx."""
    if outcome.kind in (Kind.UNKNOWN, Kind.UNAVAILABLE) or outcome.reply is None:
        return outcome.kind.value
    return f"{outcome.reply.code // 100}xx"


@dataclass(slots=True)
class Walk:
    """One walk of the route, provider by provider: what it has met so far, and the outcome
    when it ends."""

    fallback: Outcome | None = None
    """The answer to give if no provider settles the event: the first that is more than
    `unavailable`."""
    unavailable: bool = False
    """A provider tried could not be reached."""
    skipped: bool = False
    """A provider was skipped for its open circuit."""
    waits: list[float] = field(default_factory=list)
    """When each provider skipped or answered for throttling is usable again."""

    def throttled(self, until: float) -> None:
        self.waits.append(until)

    def circuit_open(self) -> None:
        self.skipped = True

    def tried(self, result: Attempted) -> Outcome | None:
        """The outcome that ends the walk, or None: try the next provider."""
        if not result.failover:
            return result.outcome
        if result.outcome.kind is Kind.UNAVAILABLE:
            self.unavailable = True
        if (
            self.fallback is None
            or self.fallback.kind is Kind.UNAVAILABLE
            # A refusal that may fail over is one for what that provider lacks (SMTPUTF8,
            # 8BITMIME); a later provider's "try later" is the event's answer. Kept as the
            # first one's 5xx, the event would fail for good though that provider is able
            # to take it once it can.
            or (self.fallback.kind is Kind.FAILED and result.outcome.kind is Kind.DEFERRED)
        ):
            self.fallback = result.outcome
        return None

    def exhausted(self) -> Outcome:
        """No provider left to try."""
        fallback = self.fallback
        if fallback is None:
            detail = (
                "every provider is throttled"
                if self.waits and not self.skipped
                else "every provider circuit is open"
            )
            return Outcome(Kind.UNAVAILABLE, None, detail=detail, data_sent=False)
        if fallback.kind is Kind.FAILED and (self.unavailable or self.skipped or self.waits):
            # Refused by one provider only for what it lacks (SMTPUTF8) while another that
            # might take it could not be tried: a 5xx would end an event that can still be
            # delivered once that one is back. Nothing was sent: retryable.
            return Outcome(
                Kind.UNAVAILABLE,
                fallback.provider,
                detail=f"{fallback.reply or ''}; another provider unavailable",
                data_sent=False,
            )
        return fallback

    def end(self, outcome: Outcome) -> Outcome:
        if self.waits and outcome.kind is Kind.UNAVAILABLE:
            # Nothing was sent only because of throttling: say when to come back, so queued
            # mail waits instead of counting an attempt (DESIGN.md §16).
            return replace(outcome, wait_until=min(self.waits))
        return outcome
