"""`zones:`: each zone's plan, caps, senders and users."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from smtpguard.config.base import Duration, _Strict
from smtpguard.config.receivers import ReceiverShaping
from smtpguard.policy.limits import PLANS
from smtpguard.policy.senders import address_problem

_ZONE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


def _argon2_hash(v: str) -> str:
    if not v.startswith(("$argon2id$", "$argon2i$", "$argon2d$")):
        raise ValueError(
            "password_hash must be an argon2 hash from `smtpguard hash-password` "
            "(plaintext passwords are not accepted)"
        )
    return v


class UserConfig(_Strict):
    username: str = Field(min_length=1, max_length=128)
    password_hash: str | None = None
    password_hashes: list[str] | None = Field(None, min_length=1)
    """During a rotation, `[new, old]`: AUTH succeeds with any; give this or password_hash."""
    hourly_cap: int | None = Field(None, ge=0)
    """The user's own caps inside the zone's (DESIGN.md §16): one internal service cannot
    spend the whole zone's budget."""
    monthly_cap: int | None = Field(None, ge=0)

    @field_validator("password_hash")
    @classmethod
    def _hash(cls, v: str | None) -> str | None:
        return None if v is None else _argon2_hash(v)

    @field_validator("password_hashes")
    @classmethod
    def _hashes(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            for h in v:
                _argon2_hash(h)
            if len(set(v)) != len(v):
                # Each costs a verification on every failed AUTH, for every user.
                raise ValueError("password_hashes lists the same hash twice")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> UserConfig:
        if (self.password_hash is None) == (self.password_hashes is None):
            raise ValueError("give exactly one of password_hash or password_hashes (a list, in a rotation)")
        return self

    @property
    def hashes(self) -> tuple[str, ...]:
        """Every hash AUTH may match, in the order given (the new one first)."""
        if self.password_hashes is not None:
            return tuple(self.password_hashes)
        assert self.password_hash is not None
        return (self.password_hash,)


def _check_or_off(value: object) -> object:
    # The loader reads YAML 1.2 booleans: `false` is False (off, as documented), `true` is
    # True (a flag the setting does not take); `on`, `yes` and `no` stay strings.
    if value is False:
        return "off"
    if value is True:
        raise ValueError("recipient_domains is true: write check (or off)")
    if value not in ("check", "off"):
        raise ValueError(f"recipient_domains is {value!r}: write check or off")
    return value


def _host_name(value: str) -> str:
    return value.strip().rstrip(".").lower()


class ZoneConfig(_Strict):
    plan: Literal["free", "solo", "starter", "business", "agency", "unlimited"] = "solo"
    hourly_cap: int | None = Field(None, ge=0)
    monthly_cap: int | None = Field(None, ge=0)
    missing_key: Literal["reject", "derive", "allow"] = "reject"
    derive_window: Duration = 600.0
    delivery: Literal["relay", "queue"] = "relay"
    default_class: str | None = None
    paused: bool = False
    senders: list[str] = Field(default_factory=list)
    users: list[UserConfig] = Field(default_factory=list)
    recipient_domains: Annotated[Literal["check", "off"], BeforeValidator(_check_or_off)] = "off"
    """check: RCPT refuses a recipient domain with a null MX (556 5.1.10) or that cannot
    receive mail (550 5.1.2); DNS trouble accepts (DESIGN.md §3, §12)."""
    mx: list[Annotated[str, BeforeValidator(_host_name)]] | None = None
    """The MX hosts the zone's sender domains should have; doctor warns about any other."""
    alert_at: list[float] = Field(default_factory=list)
    """Shares of a cap (0 < x <= 1, ascending) whose crossing logs one warning per window
    (clock hour for the hourly cap, month for the monthly): `[0.8, 0.95]`."""

    @field_validator("alert_at")
    @classmethod
    def _alert_at(cls, v: list[float]) -> list[float]:
        for x in v:
            if not 0 < x <= 1:
                raise ValueError(f"alert_at {x} is not a share of the cap: each must be > 0 and <= 1")
        if v != sorted(set(v)):
            raise ValueError("alert_at must be ascending with no repeats, e.g. [0.8, 0.95]")
        return v

    receivers: dict[str, ReceiverShaping] = Field(default_factory=dict)
    """How this zone's mail to each receiving provider is shaped (DESIGN.md §21): max_rate,
    paused, alert; names from the top-level `receivers` (or `other`)."""

    providers: list[str] | None = Field(None, min_length=1)
    """This zone's route, by provider name, in order (DESIGN.md §16): reorders or restricts
    the top-level providers for this zone. Absent: the top-level route."""

    @field_validator("senders")
    @classmethod
    def _senders(cls, v: list[str]) -> list[str]:
        for alias in v:
            probe = "x" + alias if alias.startswith("@") else alias
            problem = address_problem(probe)
            if problem:
                raise ValueError(f"sender alias {alias!r}: {problem}")
        return v


def plan_send_as(zone: ZoneConfig) -> bool:
    return PLANS[zone.plan].send_as
