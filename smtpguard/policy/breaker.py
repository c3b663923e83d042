"""A circuit breaker per provider, as a pure state machine (DESIGN.md §6).

closed ──failure_threshold consecutive failures──▶ open ──cooldown──▶ half_open
half_open: exactly one probe; success ▶ closed, failure ▶ open (cooldown again).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Circuit(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class Breaker:
    threshold: int = 5
    cooldown: float = 30.0
    circuit: Circuit = Circuit.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False
    """Half-open only: the single probe is out."""

    def allow(self, now: float) -> tuple[bool, Breaker]:
        """May a request go to this provider now? Claims the probe slot when half-opening."""
        if self.circuit is Circuit.CLOSED:
            return True, self
        if self.circuit is Circuit.OPEN:
            if now - self.opened_at >= self.cooldown:
                return True, replace(self, circuit=Circuit.HALF_OPEN, probing=True)
            return False, self
        if self.probing:
            return False, self
        return True, replace(self, probing=True)

    def success(self) -> Breaker:
        return replace(self, circuit=Circuit.CLOSED, failures=0, probing=False)

    def failure(self, now: float) -> Breaker:
        if self.circuit is Circuit.HALF_OPEN:
            return replace(self, circuit=Circuit.OPEN, opened_at=now, probing=False)
        failures = self.failures + 1
        if failures >= self.threshold:
            return replace(self, circuit=Circuit.OPEN, failures=failures, opened_at=now)
        return replace(self, failures=failures)

    def trip(self, now: float) -> Breaker:
        """Open at once, whatever the count: upstream refused our credentials (535)."""
        return replace(self, circuit=Circuit.OPEN, failures=self.threshold, opened_at=now, probing=False)

    def release_probe(self) -> Breaker:
        """The probe never reached the provider (e.g. the submission was abandoned)."""
        return replace(self, probing=False) if self.circuit is Circuit.HALF_OPEN else self
