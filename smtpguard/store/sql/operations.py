"""The operations both SQL stores carry out alike, as plans (statements.py) and the reading
of their rows. Written once here; each backend runs them (store/sqlite/fleet.py,
store/postgres/__init__.py).

Provider health (DESIGN.md §12, §15): every instance publishes each provider's circuit and
readiness probe; the console and /metrics read them all, ordered by provider, then instance.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from smtpguard.store.base import CircuitState, ProbeState
from smtpguard.store.sql.statements import Plan


def set_circuit(instance: str, provider: str, circuit: str, now: float) -> Plan:
    return Plan(
        "INSERT INTO circuits (instance, provider, circuit, at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (instance, provider) DO UPDATE SET circuit = excluded.circuit, at = excluded.at",
        (instance, provider, circuit, now),
    )


CIRCUITS = Plan(
    "SELECT instance, provider, circuit, at FROM circuits ORDER BY provider{bytewise}, instance{bytewise}"
)


def circuits(rows: Iterable[tuple[Any, ...]]) -> list[CircuitState]:
    return [CircuitState(str(i), str(p), str(s), float(t)) for i, p, s, t in rows]


def set_probe(instance: str, provider: str, ready: bool, detail: str, now: float) -> Plan:
    return Plan(
        "INSERT INTO probes (instance, provider, ready, detail, at) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (instance, provider) DO UPDATE SET ready = excluded.ready, "
        "detail = excluded.detail, at = excluded.at",
        (instance, provider, ready, detail, now),
    )


PROBES = Plan("SELECT instance, provider, ready, detail, at FROM probes ORDER BY provider, instance")


def probes(rows: Iterable[tuple[Any, ...]]) -> list[ProbeState]:
    return [ProbeState(i, p, bool(r), d, float(t)) for i, p, r, d, t in rows]
