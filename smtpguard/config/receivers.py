"""`receivers:` (the receiving providers' MX suffixes) and `zones.Z.receivers:` (how one
zone's mail to each is shaped), DESIGN.md §21."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated

from pydantic import BeforeValidator, Field, model_validator

from smtpguard.config.base import Duration, FieldProblem, Rate, _Strict
from smtpguard.policy.receivers import MIN_SENDS, NAME, OTHER, AlertRule, Shaping, normal_host

_SUFFIX = re.compile(r"^[a-z0-9_-]{1,63}(\.[a-z0-9_-]{1,63})+$")
_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def _share(value: object) -> object:
    """`0.1%`, `5%`, or a fraction (`0.05`): a share of the window's sends."""
    if isinstance(value, str):
        m = _SHARE.match(value)
        if not m:
            raise ValueError(f"{value!r} is not a share (write a percentage such as 0.1% or 5%)")
        value = float(m.group(1)) / 100
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("expected a share such as 0.1% or 5%")
    share = float(value)
    if not math.isfinite(share) or not 0 < share <= 1:
        raise ValueError(f"{value!r}: a share must be more than 0% and at most 100%")
    return share


Share = Annotated[float, BeforeValidator(_share)]


class ReceiverAlert(_Strict):
    complaint_rate: Share | None = None
    bounce_rate: Share | None = None
    deferral_rate: Share | None = None
    window: Duration = Field(3600.0, ge=60.0)
    """Rates are counted over consecutive windows of this length; one warning per window."""
    min_sends: int = Field(MIN_SENDS, ge=1)
    """A window's shares are judged once it has this many sends to the receiver: a share of
    a few is noise, and early in a window the events of the last one's sends outnumber it."""

    @model_validator(mode="after")
    def _some_rate(self) -> ReceiverAlert:
        if not self.rates():
            raise ValueError("an alert needs complaint_rate, bounce_rate or deferral_rate")
        return self

    def rates(self) -> dict[str, float]:
        found = {
            "complaint_rate": self.complaint_rate,
            "bounce_rate": self.bounce_rate,
            "deferral_rate": self.deferral_rate,
        }
        return {k: v for k, v in found.items() if v is not None}


class ReceiverShaping(_Strict):
    max_rate: Rate | None = None
    """Recipients per second of this receiver, from every instance sharing the store: over
    it, RCPT answers 451 4.7.1 (relay mode) or the entry waits (queue mode)."""
    paused: bool = False
    alert: ReceiverAlert | None = None
    on_alert: Annotated[str, Field(pattern="^(slow|pause)$")] | None = None
    """Off by default: an alert is for a person to judge (docs/receivers.md)."""

    @model_validator(mode="after")
    def _on_alert(self) -> ReceiverShaping:
        if self.on_alert is not None and self.alert is None:
            raise FieldProblem(("on_alert",), "on_alert needs an alert to act on")
        if self.on_alert == "slow" and self.max_rate is None:
            raise FieldProblem(("on_alert",), "on_alert: slow halves max_rate: set max_rate too")
        return self

    def shaping(self) -> Shaping:
        rule = None
        if self.alert is not None:
            rule = AlertRule(self.alert.window, self.alert.rates(), self.alert.min_sends)
        return Shaping(self.max_rate, self.paused, rule, self.on_alert)


def _suffixes(value: object) -> object:
    if isinstance(value, dict):
        raise ValueError(
            "expected a list of MX host suffixes, e.g. [google.com, googlemail.com]; "
            "max_rate, paused and alert go under zones.ZONE.receivers"
        )
    if not isinstance(value, list):
        raise ValueError("expected a list of MX host suffixes, e.g. [google.com, googlemail.com]")
    out = []
    for item in value:
        if not isinstance(item, str) or not _SUFFIX.match(normal_host(item)):
            raise ValueError(f"{item!r} is not a host name suffix such as google.com")
        out.append(normal_host(item))
    return out


Suffixes = Annotated[list[str], BeforeValidator(_suffixes)]


def check_receiver_names(names: Mapping[str, object], at: tuple[str | int, ...]) -> None:
    for name in names:
        if not NAME.match(name) or name == OTHER:
            raise FieldProblem(
                (*at, name),
                f"receiver name {name!r} must be lower-case letters, digits, _ or - "
                "(at most 32) and not 'other'",
            )


def unknown_receiver(name: str, known: set[str]) -> str | None:
    """Why a zone's `receivers.NAME` names no receiver, else None."""
    if name == OTHER or name in known:
        return None
    return f"receiver {name!r} is not one of receivers: {', '.join(sorted(known | {OTHER}))}"
