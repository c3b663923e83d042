"""`workers:`: how many worker processes, and what `auto` comes to on this machine."""

from __future__ import annotations

import os
from typing import Literal

MAX_WORKERS = 256


def _workers(value: object) -> object:
    # One message for both spellings, rather than one per member of the union.
    if value == "auto" or (type(value) is int and 1 <= value <= MAX_WORKERS):
        return value
    raise ValueError(f"must be a whole number from 1 to {MAX_WORKERS}, or auto; got {value!r}")


def worker_count(workers: int | Literal["auto"]) -> int:
    """`workers: auto` is the cores this process may run on (its CPU affinity, which a
    container's cpuset narrows), else every core the machine has."""
    if workers != "auto":
        return workers
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))
