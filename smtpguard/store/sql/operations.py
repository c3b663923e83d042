"""The operations both SQL stores carry out alike, as plans (statements.py) and the reading
of their rows. Written once here; each backend runs them (store/sqlite/fleet.py,
store/postgres/fleet.py).

Provider health (DESIGN.md §6, §12): every instance publishes each provider's circuit and
readiness probe; the console and /metrics read them all, ordered by provider, then instance.
Connection slots (§16) and AUTH failures (§17: the lockout stays global) are counted across
instances.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from smtpguard.store.base import CircuitState, ProbeState
from smtpguard.store.sql.statements import Lock, Plan, Script


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


def throttled(now: float) -> Plan:
    return Plan("SELECT provider, until FROM throttles WHERE until > ?", (now,))


def throttles(rows: Iterable[tuple[Any, ...]]) -> dict[str, float]:
    return {str(p): float(u) for p, u in rows}


def hold_connection(provider: str, holder: str, limit: int, until: float, now: float) -> Script[bool]:
    # One provider's slots are taken one at a time: each sees every earlier one.
    yield Lock(f"conn:{provider}")
    yield Plan("DELETE FROM connection_slots WHERE provider = ? AND until <= ?", (provider, now))
    mine = yield Plan(
        "UPDATE connection_slots SET until = ? WHERE provider = ? AND holder = ?", (until, provider, holder)
    )
    if mine.rowcount:
        return True
    held = yield Plan("SELECT count(*) FROM connection_slots WHERE provider = ?", (provider,))
    if int(held.rows[0][0]) >= limit:
        return False
    yield Plan(
        "INSERT INTO connection_slots (provider, holder, until) VALUES (?, ?, ?)", (provider, holder, until)
    )
    return True


def drop_connection(provider: str, holder: str) -> Plan:
    return Plan("DELETE FROM connection_slots WHERE provider = ? AND holder = ?", (provider, holder))


def auth_failure(ip: str, now: float, window: float) -> Script[int]:
    # One address's failures are counted one at a time: each sees every earlier one.
    yield Lock(f"auth:{ip}")
    yield Plan("INSERT INTO auth_failures (ip, at) VALUES (?, ?)", (ip, now))
    counted = yield auth_failures(ip, now, window)
    return int(counted.rows[0][0])


def auth_failures(ip: str, now: float, window: float) -> Plan:
    return Plan("SELECT count(*) FROM auth_failures WHERE ip = ? AND at > ?", (ip, now - window))


def count(rows: list[tuple[Any, ...]]) -> int:
    return int(rows[0][0])
