"""The roles both SQL stores carry out alike, written once: each method builds its plans
(operations.py) and hands them to the backend's Runner (store/sqlite/access.py,
store/postgres/pool.py), which runs them on its own connection, in its own transaction,
with its own error translation. Each backend's fleet.py, controls.py and desk.py inherit
these and add what its schema does its own way."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from smtpguard.policy.ledger import Record
from smtpguard.store.base import (
    CapUsage,
    CircuitState,
    IdField,
    ProbeState,
    QueueEntry,
    StoredEvent,
    Suppression,
    ZoneAudit,
)
from smtpguard.store.sql import cursors, operations
from smtpguard.store.sql.statements import Plan, Script

T = TypeVar("T")
P = ParamSpec("P")


class Runner(ABC):
    """What a backend gives the shared roles: a read, a write of one statement, and a
    script of several in one transaction (statements.py), all raising StoreUnavailable.
    A script is made by `make(*args)` at each run of the transaction: SQLite's writer runs
    an operation again, alone, when another of its batch failed."""

    @abstractmethod
    async def _rows(self, plan: Plan) -> list[tuple[Any, ...]]: ...

    @abstractmethod
    async def _execute(self, plan: Plan) -> None: ...

    @abstractmethod
    async def _script(self, make: Callable[P, Script[T]], /, *args: P.args, **kwargs: P.kwargs) -> T: ...

    @abstractmethod
    def now(self) -> float:
        # The store's clock: SQLiteStore's own, OnServerClock's (listed before Runner in
        # Pool's bases, so that it, not this, is found).
        ...


class Fleet(Runner):
    # --- provider health (DESIGN.md §6, §12) -------------------------------------------------
    async def set_circuit(self, instance: str, provider: str, circuit: str, now: float) -> None:
        await self._execute(operations.set_circuit(instance, provider, circuit, now))

    async def circuits(self) -> list[CircuitState]:
        return operations.circuits(await self._rows(operations.CIRCUITS))

    async def set_probe(self, instance: str, provider: str, ready: bool, detail: str, now: float) -> None:
        await self._execute(operations.set_probe(instance, provider, ready, detail, now))

    async def probes(self) -> list[ProbeState]:
        return operations.probes(await self._rows(operations.PROBES))

    # --- provider throttling (§16) -----------------------------------------------------------
    async def throttled(self, now: float) -> dict[str, float]:
        return operations.throttles(await self._rows(operations.throttled(now)))

    async def hold_connection(self, provider: str, holder: str, limit: int, until: float, now: float) -> bool:
        return await self._script(operations.hold_connection, provider, holder, limit, until, now)

    async def drop_connection(self, provider: str, holder: str) -> None:
        await self._execute(operations.drop_connection(provider, holder))

    # --- AUTH brute force (§17) --------------------------------------------------------------
    async def auth_failure(self, ip: str, now: float, window: float) -> int:
        return await self._script(operations.auth_failure, ip, now, window)

    async def auth_failures(self, ip: str, now: float, window: float) -> int:
        return operations.count(await self._rows(operations.auth_failures(ip, now, window)))


class Controls(Runner):
    # --- zones (§5, §16) ---------------------------------------------------------------------
    async def set_paused(self, zone: str, paused: bool) -> None:
        await self._execute(operations.set_paused(zone, paused))

    async def is_paused(self, zone: str) -> bool:
        return bool(await self._rows(operations.is_paused(zone)))

    async def set_class_paused(self, zone: str, message_class: str, paused: bool) -> None:
        await self._execute(operations.set_class_paused(zone, message_class, paused))

    async def paused_classes(self) -> set[tuple[str, str]]:
        return operations.paused_classes(await self._rows(operations.PAUSED_CLASSES))

    async def cap_usage(self, zone: str, now: float, month: str) -> CapUsage:
        return operations.cap_usage(await self._rows(operations.cap_usage_of(zone, now, month)))

    async def counts(self, zone: str) -> dict[str, int]:
        return operations.counts(await self._rows(operations.counters(zone)))

    # --- suppression (§3) --------------------------------------------------------------------
    async def suppressed(self, zone: str, address: str) -> str | None:
        return operations.listed_in(await self._rows(operations.suppressed(zone, address)))

    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        return await self._script(operations.suppress_add, zone, address, reason, now)

    async def suppress_remove(self, zone: str, address: str) -> bool:
        return await self._script(operations.suppress_remove, zone, address)

    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        return operations.versions(await self._rows(operations.suppression_versions(zone)), zone)

    async def suppress_list(self, zone: str) -> list[Suppression]:
        return operations.suppressions(await self._rows(operations.suppress_list(zone)))


class Desk(Runner):
    @abstractmethod
    def _id_lookup(self, field: IdField, value: str) -> tuple[str, list[str]]:
        """Where this store keeps a record's `field` (an expression over a row of `events`,
        its alias written `{t}`) and the forms `value` may stand there in."""
        ...

    # --- reconciliation cursors (§19) -------------------------------------------------------
    async def reconcile_cursor(self, name: str) -> float | None:
        return await self._script(cursors.cursor, name)

    async def advance_reconcile_cursor(self, name: str, expected: float | None, new: float) -> bool:
        return await self._script(cursors.advance, name, expected, new)

    # --- provider events (§13) ---------------------------------------------------------------
    async def find_records(self, field: IdField, value: str) -> list[Record]:
        column, forms = self._id_lookup(field, value)
        return operations.records(await self._rows(operations.find_records(column, forms)))

    async def records_for_event(self, field: IdField, value: str) -> list[Record]:
        column, forms = self._id_lookup(field, value)
        return operations.records(await self._rows(operations.records_for_event(column, forms)))

    async def apply_event(self, zone: str, key: str, event: StoredEvent, suppress_reason: str | None) -> bool:
        return await self._script(operations.apply_event, zone, key, event, suppress_reason)

    async def remember_nonce(self, name: str, digest: str, until: float) -> bool:
        return await self._script(operations.remember_nonce, name, digest, until, self.now())

    # --- the operator's desk (§14) -----------------------------------------------------------
    async def list_records(
        self, zone: str, state: str | None, since: float | None, before: float | None, limit: int
    ) -> list[Record]:
        plan = operations.list_records(zone, state, since, before, limit)
        return operations.records(await self._rows(plan))

    async def audit_add(self, zone: str, entry: ZoneAudit) -> None:
        await self._execute(operations.audit_add(zone, entry))

    async def queue_entries(self, zone: str | None) -> list[QueueEntry]:
        rows = await self._rows(operations.queue_entries(zone))
        return operations.entries(rows, self.now())

    async def queue_lanes(self) -> set[str]:
        return operations.lanes(await self._rows(operations.QUEUE_LANES))

    async def queue_depths(self) -> dict[tuple[str, str], int]:
        return operations.queue_depths(await self._rows(operations.QUEUE_DEPTHS))
