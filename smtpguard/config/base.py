"""What every part of the config schema is built from: the strict model, the value types
YAML spells as strings (durations, sizes, rates, paths), host:port, and the two errors.

A model checking several fields together raises FieldProblem with the location of the field
at fault, relative to the model, so the error names that field's line, not the section's.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, ClassVar, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, field_validator, model_validator

from smtpguard.units import parse_duration, parse_rate, parse_size

Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
Rate = Annotated[float, BeforeValidator(parse_rate)]
"""Messages per second, written `10/s`, `600/m` or `36000/h`."""


def _path(value: object) -> object:
    # YAML has no path type: a string is the only spelling, and strict mode takes it here.
    return Path(value) if isinstance(value, str) and value else value


FilePath = Annotated[Path, BeforeValidator(_path)]


_DNS_LABELS = re.compile(r"[A-Za-z0-9_-]{1,63}(\.[A-Za-z0-9_-]{1,63})*")


class ConfigError(Exception):
    """A config that cannot be used; `problems` are one line each, with path and line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class FieldProblem(ValueError):
    """A problem with one field found by a model's own check (a cross-field rule): `loc` is
    the field's path inside the model that raises it, e.g. `("zones", "acme", "users", 0)`."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


class _Strict(BaseModel):
    # strict: YAML already has numbers and booleans; a quoted "20" or "on" is a mistake to
    # show, not a value to coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{value!r} is not host:port")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"{value!r} has no host")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ValueError(f"port {p} is out of range")
    return host, p


class _Listening(_Strict):
    """A listener's `address`, host:port, checked when the file is read."""

    address: str

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        _host_port(v)
        return v

    @property
    def host(self) -> str:
        return _host_port(self.address)[0]

    @property
    def port(self) -> int:
        return _host_port(self.address)[1]


class _Secret(_Strict):
    """A secret named by environment variable or file (the model's `*_env` and `*_file`
    fields), never inline: exactly one of them is given."""

    _secret_noun: ClassVar[str] = "secret"
    """What the error calls it: "never the secret inline", "never the key inline"."""

    @model_validator(mode="after")
    def _one_secret(self) -> Self:
        fields = [f for f in type(self).model_fields if f.endswith(("_env", "_file"))]
        given = [f for f in fields if getattr(self, f) is not None]
        if len(given) != 1:
            names = " or ".join(fields)
            raise ValueError(f"give exactly one of {names} (never the {self._secret_noun} inline)")
        return self


def secret_when_needed(model: BaseModel, env: str, file: str, needed_by: str) -> None:
    """An optional secret: at most one of the `env` and `file` fields, and one of them
    whenever the `needed_by` field is set (named, never inline)."""
    given_env, given_file = getattr(model, env), getattr(model, file)
    if given_env and given_file:
        raise FieldProblem((file,), f"give {env} or {file}, not both")
    if getattr(model, needed_by) and not (given_env or given_file):
        raise FieldProblem((needed_by,), f"{needed_by} needs {env} or {file} (never inline)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
