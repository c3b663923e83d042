"""Durations ("60s", "30d") and sizes ("25MB", "64KiB") as written in the config.

Pure parsing: returns seconds (float) and bytes (int); raises ValueError with a message
fit to show an operator next to the YAML line.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_duration(value: object) -> float:
    """Seconds from `90`, `90s`, `500ms`, `10m`, `1h`, `30d`, `2w`. Bare numbers are seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 60s, 10m, 30d")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        m = _DURATION_RE.match(value)
        if not m:
            raise ValueError(f"{value!r} is not a duration (use a number and ms, s, m, h, d or w)")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ValueError("expected a duration such as 60s, 10m, 30d")
    # YAML reads `.nan` and `.inf` as floats: a NaN lease compares false with every clock
    # reading, so every in-flight record would look expired.
    if not math.isfinite(seconds):
        raise ValueError("a duration must be a finite number")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from `1024`, `64KB`, `25MB` (10^6) or `25MiB` (2^20)."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 25MB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _SIZE_UNITS:
            raise ValueError(f"{value!r} is not a size (use B, KB, MB, GB, KiB, MiB or GiB)")
        scaled = float(m.group(1)) * _SIZE_UNITS[unit]
        if not math.isfinite(scaled):
            raise ValueError("the size is too large")
        size = int(scaled)
    else:
        raise ValueError("expected a size such as 25MB")
    if size < 0:
        raise ValueError("a size cannot be negative")
    return size


def format_duration(seconds: float) -> str:
    """The shortest exact spelling, for messages and `check-config` output."""
    for unit in ("w", "d", "h", "m", "s"):
        factor = _DURATION_UNITS[unit]
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    # repr is the shortest exact decimal; Decimal keeps it out of exponent notation, which
    # parse_duration does not read ("1e-05s"), and %g would round (123456.5 -> "123456s").
    return f"{Decimal(repr(float(seconds))).normalize():f}s"


_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|m|h)\s*$")
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(value: object) -> float:
    """Messages per second from `10/s`, `600/m` or `36000/h` (a provider's `max_rate`).

    Only the slash form: a bare number would leave the reader to guess its unit, and
    providers publish their limits per second, minute or hour."""
    if not isinstance(value, str):
        raise ValueError("expected a rate such as 10/s, 600/m or 36000/h")
    m = _RATE_RE.match(value)
    if not m:
        raise ValueError(f"{value!r} is not a rate (use a number, a slash and s, m or h: 10/s, 600/m)")
    rate = float(m.group(1)) / _RATE_UNITS[m.group(2)]
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError("a rate must be more than zero")
    return rate
