"""`queue:`: retries, workers and the message classes with their age limits and priorities."""

from __future__ import annotations

from pydantic import Field, model_validator

from smtpguard.config.base import Duration, FieldProblem, _Strict


class Backoff(_Strict):
    base: Duration = 60.0
    max: Duration = 3600.0


class MessageClass(_Strict):
    max_age: Duration
    priority: int = Field(ge=0)


class QueueConfig(_Strict):
    backoff: Backoff = Backoff()
    workers: int = Field(16, ge=1, le=1024)
    """Deliveries in flight at once per instance (bounded further by each provider's pool)."""
    poll_interval: Duration = Field(1.0, gt=0)
    """How often an idle worker looks for due entries (other instances' acceptances, retries
    coming due); a local acceptance wakes it at once."""
    class_header: str = "X-Message-Class"
    default_class: str = "transactional"
    classes: dict[str, MessageClass] = Field(
        default_factory=lambda: {
            "otp": MessageClass(max_age=600, priority=0),
            "transactional": MessageClass(max_age=3 * 86400, priority=1),
            "bulk": MessageClass(max_age=86400, priority=2),
        }
    )

    @model_validator(mode="after")
    def _default_known(self) -> QueueConfig:
        if self.default_class not in self.classes:
            raise FieldProblem(
                ("default_class",),
                f"default_class {self.default_class!r} is not one of classes "
                f"({', '.join(sorted(self.classes))})",
            )
        return self
