"""The state store: one interface, three backends (DESIGN.md §7, §15).

Promises every backend keeps (the contract suite in tests/store/test_store_contract.py checks
each one against SQLite, a real redis-server and a real PostgreSQL):

- **Durable before answer.** When a write coroutine returns, the write survives a crash of
  this process (SQLite: committed with synchronous=FULL; Redis: as durable as the server's
  `appendfsync`, see docs/redis.md; PostgreSQL: committed, as `synchronous_commit` says).
- **reserve is atomic across instances.** Version check, pause flag, cap count and the
  record write happen as one indivisible step: of N concurrent reservations of one key with
  the same expected version, exactly one gets `Reserved`; the others get `Conflict` with
  the record that won. Caps never overshoot, whatever the concurrency.
- **put is compare-and-swap.** It writes only over the expected version; otherwise it
  returns the current record so the caller can decide again (policy/ledger.py decides).
- **Retries are harmless.** settle/refund/suppress/pause are idempotent; refunding a token
  twice returns one unit. A write re-run after its reply was lost (a connection reset
  between the write and its answer) recognises its own earlier write and answers as the
  first run did: put/enqueue/requeue/reserve over a record already equal to the one being
  written succeed, and a cap token already counted is not counted again (DESIGN.md §11.4).
- **One clock.** `now()` is the store's clock, the same for every instance sharing it:
  leases and windows are measured on it (DESIGN.md §11.5).
- **Failure is loud.** An unreachable backend raises StoreUnavailable; nothing is ever
  relayed without a reservation.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from smtpguard.policy.events import StoredEvent as StoredEvent  # re-exported for the backends
from smtpguard.policy.events import bare_message_id
from smtpguard.policy.ledger import Record
from smtpguard.policy.limits import CapCheck, CapReached
from smtpguard.policy.queue import HELD as HELD  # re-exported: stores write it as a due time
from smtpguard.policy.record import Audited
from smtpguard.policy.throttle import Slot as Slot  # re-exported for the backends


class StoreUnavailable(Exception):
    """The backend cannot be reached or refused the write: answer 451 4.3.0, send nothing."""


class StoreUnfit(Exception):
    """The backend answers, but this instance must not serve on it: a schema older than
    this release that its role may not upgrade, a SQLite file this process may not write.
    `serve` exits naming the problem."""


UNREACHABLE = "store unreachable"
REFUSES_WRITES = "store refuses writes"
"""The reasons Store.unready gives (/readyz answers 503 with them)."""


@runtime_checkable
class ReportsReplication(Protocol):
    """A backend that knows whether a synchronous standby holds every write (PostgreSQL)."""

    @property
    def synchronous(self) -> bool | None:
        """True: a synchronous standby is streaming; False: none; None: not known (the
        role may not read it)."""


class StoreMissing(StoreUnavailable):
    """Opened with `create=False` (the CLI) and there is no store there: a wrong path or
    working directory, not an empty store to answer "no record" from."""


@dataclass(frozen=True, slots=True)
class Reserved:
    pass


@dataclass(frozen=True, slots=True)
class Conflict:
    current: Record | None


@dataclass(frozen=True, slots=True)
class Paused:
    pass


ReserveResult = Reserved | Conflict | Paused | CapReached


@dataclass(frozen=True, slots=True)
class Suppression:
    zone: str
    address: str
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class QueuedMessage:
    """What store-and-forward keeps beside the ledger record until the event is final."""

    sender: str
    recipients: tuple[str, ...]
    content: bytes
    priority: int
    smtputf8: bool = False
    """The client declared SMTPUTF8 (RFC 6531): the relay declares it to the provider too."""


def entry_columns(record: Record, message: QueuedMessage) -> tuple[str, int, float, float, str, str, bytes]:
    """What every store keeps of a new queue entry, in this order: lane, priority, when it is
    first due (the record's next attempt, else at once), when it was enqueued, sender,
    recipients (a JSON list), content."""
    due = record.next_attempt_at if record.next_attempt_at is not None else record.updated_at
    recipients = json.dumps(list(message.recipients))
    lane = record.lane or ""
    return (lane, message.priority, due, record.updated_at, message.sender, recipients, message.content)


@dataclass(frozen=True, slots=True)
class Claimed:
    record: Record
    message: QueuedMessage


@dataclass(frozen=True, slots=True)
class QueueEntry:
    zone: str
    key: str
    lane: str
    state: str
    due_at: float | None
    claimed: bool
    enqueued_at: float
    size: int


@dataclass(frozen=True, slots=True)
class CircuitState:
    instance: str
    provider: str
    circuit: str
    at: float


@dataclass(frozen=True, slots=True)
class ProbeState:
    instance: str
    provider: str
    ready: bool
    detail: str
    at: float


@dataclass(frozen=True, slots=True)
class CapUsage:
    hour: int
    month: int


@dataclass(frozen=True, slots=True)
class ZoneAudit(Audited):
    """An operator's action on a zone (DESIGN.md §14): pause, resume, suppress, queue drop,
    and each decision on a held record (which its record's own audit holds too)."""

    key: str = ""
    """The record's key, or the address for a suppression change; '' for the zone itself."""
    note: str = ""


IdField = Literal["sg_id", "message_id", "upstream_id"]


def id_forms(field: IdField, value: str) -> list[str]:
    """The forms a record may hold an id in: a Message-ID with and without its angle
    brackets (clients write either), an upstream id as given."""
    if field == "message_id":
        bare = bare_message_id(value)
        return [bare, f"<{bare}>"]
    return [value.strip()]


class Store(Protocol):
    async def open(self) -> None:
        """Connect and create the schema if needed. Idempotent."""

    async def close(self) -> None:
        """Flush pending writes and release connections."""

    async def ping(self) -> bool:
        """True when the backend answers now."""

    async def unready(self) -> str | None:
        """Why this instance cannot serve on the backend now, for /readyz: UNREACHABLE, or
        REFUSES_WRITES and why (a read-only file, a Redis replica, a PostgreSQL standby);
        None when it answers and would take a write. Cheap, and never a write: one round
        trip, as ping."""

    def now(self) -> float:
        """The store's clock in epoch seconds: what every instance sharing the store agrees
        on (Redis: TIME, tracked locally between samples; SQLite: this machine's clock)."""

    async def durability_problems(self) -> list[str]:
        """Settings under which the backend may forget an acknowledged write, each naming
        the setting (empty when none). A forgotten reservation is a duplicate send."""

    # --- ledger ------------------------------------------------------------------------------
    async def get(self, zone: str, key: str) -> Record | None: ...

    async def reserve(
        self, record: Record, expected_version: int | None, cap: CapCheck | None, paused: bool
    ) -> ReserveResult:
        """Atomically: the key's version must equal `expected_version` (None: absent), else
        Conflict(current) — checked first, so a duplicate is answered even when paused or
        capped; then the zone must not be paused (`paused` forces it); then, when `cap` is
        given, one unit is consumed under the monthly then hourly cap — and, when
        `cap.user` is set, one under the user's own caps too (DESIGN.md §16): both units or
        neither, never overshooting either cap (CapReached.user says the user's refused);
        then `record` is written."""

    async def put(self, record: Record, expected_version: int | None) -> Conflict | None:
        """Compare-and-swap on the version (None: the key must be absent). None when
        written, else Conflict with the current record — `current` is None when the record
        is gone, so a vanished key is never mistaken for a successful write."""

    async def refund(self, zone: str, token: str, month: str) -> None:
        """Return the cap unit consumed under `token` (nothing reached a provider), and the
        user's unit counted with it, if any: the token alone finds both."""

    async def purge(self, now: float, retention: float) -> int:
        """Delete settled records not updated for `retention`, and stale window entries.
        Returns the number of ledger records deleted. Never called on the hot path."""

    async def consume_cap(self, cap: CapCheck) -> CapReached | None:
        """Atomically consume one unit under the monthly then hourly cap (store-and-forward
        checks caps at delivery time, not at acceptance), and with `cap.user` one under the
        user's own caps in the same step, as reserve does."""

    # --- store-and-forward queue (DESIGN.md §4a) ---------------------------------------------
    async def enqueue(
        self, record: Record, expected_version: int | None, message: QueuedMessage
    ) -> Conflict | None:
        """Atomically: compare-and-swap the record as put() does and keep `message` in the
        record's lane, due at record.next_attempt_at. The 250 depends on this being durable."""

    async def claim(self, now: float, quotas: list[tuple[str, int]], lease: float) -> list[Claimed]:
        """Atomically claim due, unclaimed entries: up to each lane's quota, then what is
        left of sum(quotas) from any lane in the quotas' order. A claim hides the entry from
        every other claim until now + lease (a worker that dies gives it back that way)."""

    async def requeue(self, record: Record, expected_version: int, due: float | None) -> Conflict | None:
        """Compare-and-swap the record; with due=None take its entry off the queue (the event
        is final), else make the entry due at `due` and unclaimed (HELD: kept, never due)."""

    async def queue_entries(self, zone: str | None) -> list[QueueEntry]: ...

    async def queue_depths(self) -> dict[tuple[str, str], int]:
        """Entries per (zone, lane), lanes with none left out: a count, cheap enough for a
        gauge every few seconds (queue_entries reads every entry)."""

    async def queue_lanes(self) -> set[str]:
        """The lanes that hold entries now, in any zone (the worker serves lanes no
        configured class names any more)."""

    # --- zones -------------------------------------------------------------------------------
    async def set_paused(self, zone: str, paused: bool) -> None: ...

    async def is_paused(self, zone: str) -> bool: ...

    async def cap_usage(self, zone: str, now: float, month: str) -> CapUsage: ...

    async def user_cap_usage(
        self, zone: str, usernames: list[str], now: float, month: str
    ) -> dict[str, CapUsage]:
        """Each named user's own cap units (DESIGN.md §16) in the last hour and in `month`,
        one entry per name (zeros for a user that has sent none)."""

    async def set_class_paused(self, zone: str, message_class: str, paused: bool) -> None:
        """Pause (or resume) one message class of a zone (DESIGN.md §16). Idempotent."""

    async def paused_classes(self) -> set[tuple[str, str]]:
        """Every (zone, class) paused now, fleet-wide: one small read, so an instance can
        look again every half second and a pause holds everywhere within a second."""

    async def add_counts(self, zone: str, counts: dict[str, int]) -> None:
        """Add to the zone's statistics counters (sent, duplicate, rejected:<reason>, …)."""

    async def counts(self, zone: str) -> dict[str, int]: ...

    # --- suppression -------------------------------------------------------------------------
    async def suppressed(self, zone: str, address: str) -> str | None:
        """Which list holds the (normalised) address: the zone name, 'global', or None."""

    async def suppress_add(self, zone: str, address: str, reason: str, now: float) -> bool:
        """True when newly added; an existing entry keeps its first reason."""

    async def suppress_remove(self, zone: str, address: str) -> bool: ...

    async def suppress_list(self, zone: str) -> list[Suppression]: ...

    async def suppression_versions(self, zone: str) -> tuple[int, int]:
        """Change counters of the zone's list and of the global list: a cache that saw the
        same pair still holds both lists exactly."""

    # --- provider events (DESIGN.md §13) -----------------------------------------------------
    async def find_records(self, field: IdField, value: str) -> list[Record]:
        """Records, in any zone, whose sg_id (the id in smtpguard's replies), message_id
        (either form, see id_forms) or upstream_id is `value` (an index lookup; at most 100)."""

    async def records_for_event(self, field: IdField, value: str) -> list[Record]:
        """The records a provider event naming `value` may be about: as find_records, but
        when records of two zones hold the id, none (an id two zones share names neither,
        however many records share it; decided in the query, not after a limit). Newest
        first, at most 100."""

    async def apply_event(self, zone: str, key: str, event: StoredEvent, suppress_reason: str | None) -> bool:
        """Atomically, once per (zone, event.source, event.id): add the event to the
        record's history and, with a reason, put event.recipient on the zone's list (an
        existing entry keeps its first reason). False when the event was applied before:
        nothing changes. Event ids are kept for `retention` (purge)."""

    async def provider_events(self, zone: str, key: str) -> list[StoredEvent]:
        """The record's provider events, in the order they arrived."""

    async def remember_nonce(self, name: str, digest: str, until: float) -> bool:
        """Atomically, fleet-wide: remember `name` with `digest` until `until` (epoch) and
        answer True, or, if `name` is remembered already, answer whether with this same
        digest. A signature scheme that signs a nonce but not the body (Mailgun) needs it:
        the nonce reused with another body is a replay."""

    async def reconcile_cursor(self, name: str) -> float | None:
        """Where reconciliation of the log API `name` (DESIGN.md §19) has read up to: the end
        of the last period whose events are applied, on the store's clock; None: never."""

    async def advance_reconcile_cursor(self, name: str, expected: float | None, new: float) -> bool:
        """Compare-and-swap, fleet-wide: set the cursor to `new` if it is `expected` (None:
        absent) and answer True; else change nothing and answer False (another instance
        applied the period first, which the events' own idempotence made harmless)."""

    # --- the operator's desk (DESIGN.md §14) -------------------------------------------------
    async def list_records(
        self, zone: str, state: str | None, since: float | None, before: float | None, limit: int
    ) -> list[Record]:
        """The zone's records (of one state, or all), newest `updated_at` first, with
        since <= updated_at < before; an index walk, never a scan of the zone."""

    async def state_counts(self, zone: str) -> dict[str, int]:
        """Records per state in the zone (states with none are left out)."""

    async def audit_add(self, zone: str, entry: ZoneAudit) -> None: ...

    async def audit_log(self, zone: str, since: float, limit: int = 1000) -> list[ZoneAudit]:
        """The zone's operator actions since `since`, newest first."""

    # --- provider health, for operators (each instance keeps its own breaker) ---------------
    async def set_circuit(self, instance: str, provider: str, circuit: str, now: float) -> None:
        """Publish one instance's circuit for one provider (written on every transition)."""

    async def circuits(self) -> list[CircuitState]: ...

    async def set_probe(self, instance: str, provider: str, ready: bool, detail: str, now: float) -> None:
        """Publish one instance's last probe of one provider (DESIGN.md §12; written when its
        readiness changes), so `stats` shows whether each standby could take over."""

    async def probes(self) -> list[ProbeState]: ...

    # --- provider throttling, fleet-wide (DESIGN.md §16) -------------------------------------
    async def rate_slot(self, provider: str, interval: float, max_wait: float, now: float) -> Slot:
        """Reserve the provider's next send slot (policy/throttle.py gcra): slots `interval`
        apart for every instance together. Atomic: of concurrent callers each gets its own
        slot, so no window holds more than the rate allows. A slot more than `max_wait`
        ahead is refused and nothing is reserved."""

    async def set_throttled(self, provider: str, until: float) -> None:
        """Mark the provider throttled until `until` for every instance (a rate-limit reply).
        Never shortens a throttle already in place; idempotent."""

    async def throttled(self, now: float) -> dict[str, float]:
        """Providers throttled after `now`, with the time each throttle ends."""

    async def hold_connection(self, provider: str, holder: str, limit: int, until: float, now: float) -> bool:
        """Take or renew one of the provider's `limit` connection slots for `holder` until
        `until`. Atomic across instances: never more than `limit` unexpired holders. A
        holder that already has a slot renews it (True) even when the limit was lowered;
        slots whose lease ended by `now` are free (a crashed instance's come back)."""

    async def drop_connection(self, provider: str, holder: str) -> None:
        """Give the holder's slot back (its connection closed). Idempotent."""

    # --- AUTH brute force (shared by every instance) -----------------------------------------
    async def auth_failure(self, ip: str, now: float, window: float) -> int:
        """Count one failed AUTH from `ip`; return the failures within `window`."""

    async def auth_failures(self, ip: str, now: float, window: float) -> int: ...


# Backends are imported on use, so a SQLite deployment never imports redis.
BACKENDS: dict[str, str] = {
    "sqlite": "smtpguard.store.sqlite:SQLiteStore",
    "redis": "smtpguard.store.redis:RedisStore",
    "rediss": "smtpguard.store.redis:RedisStore",
    "redis+sentinel": "smtpguard.store.redis:RedisStore",
    "postgresql": "smtpguard.store.postgres:PostgresStore",
    "postgres": "smtpguard.store.postgres:PostgresStore",
}


def store_from_url(
    url: str,
    password: str | None = None,
    *,
    read_only: bool = False,
    create: bool = True,
    wait: tuple[int, float] | None = None,
    pool_size: int | None = None,
) -> Store:
    """The backend for `url`. `read_only`: the caller only reads (history, stats, lists) and
    the backend may open itself so; `create=False`: a store that does not exist yet is
    StoreMissing rather than created empty (every CLI command). Both concern a store file:
    only SQLite is given them, and only a server (Redis, PostgreSQL) the `password`. `wait`:
    (replicas, timeout in seconds) for Redis's WAIT after each ledger write. `pool_size`:
    PostgreSQL's most connections per process."""
    scheme = url.split(":", 1)[0]
    target = BACKENDS.get(scheme)
    if target is None:
        raise ValueError(f"unknown store scheme {scheme!r}")
    module, cls = target.split(":")
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        # redis-py and psycopg are extras: a SQLite-only install carries neither.
        extra = "postgres" if scheme.startswith("postgres") else "redis"
        raise StoreUnavailable(
            f"the {scheme} store needs the {e.name} package: pip install 'smtpguard[{extra}]'"
        ) from None
    factory = getattr(imported, cls)
    options: dict[str, object] = (
        {"read_only": read_only, "create": create} if scheme == "sqlite" else {"password": password}
    )
    if wait is not None:
        options["wait"] = wait
    if pool_size is not None:
        options["pool_size"] = pool_size
    store: Store = factory(url, **options)
    return store
