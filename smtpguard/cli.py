"""`smtpguard …`: the only place that turns errors into exit codes (DESIGN.md §8).

Exit codes (EXIT_CODES, also in `--help` and docs/runbook.md): 0 success, 1 a refused or
failed operation (bad config, unknown zone, a state that does not allow the command), 2 bad
usage, 3 no such record (or list entry), 4 the store is unavailable or does not exist.
Errors are one line on stderr, never a traceback. Options may come anywhere on the line,
`-c FILE` before or after the command. `--json` documents are objects whose `schema` is
JSON_SCHEMA; a change that breaks a reader bumps it.

Commands that only read (history, stats, queue list, suppress list/export) open the store
read-only; no command creates a store: a wrong path or working directory is an error that
says so, not an empty store that answers "no record".
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import getpass
import io
import json
import math
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from smtpguard import __version__, class_pauses, desk
from smtpguard.config import DEFAULT_CONFIG, Config, ConfigError, ZoneConfig, load, read_secret
from smtpguard.policy import ledger
from smtpguard.policy.limits import Caps, caps_for, month_of, user_caps_for
from smtpguard.policy.senders import address_problem, normalize_address
from smtpguard.store import Store, StoreMissing, StoreUnavailable, store_from_url
from smtpguard.store.base import CapUsage, IdField, StoredEvent, ZoneAudit
from smtpguard.units import parse_duration

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORE = 4
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_FAILED: "refused or failed (bad config, unknown zone, a state that does not allow it)",
    EXIT_USAGE: "bad usage (unknown command or option, missing argument)",
    EXIT_NOT_FOUND: "no such record, queue entry or list entry",
    EXIT_STORE: "store unavailable, or no store at the configured path",
}
JSON_SCHEMA = 1
"""The version of every `--json` document (its `schema` key)."""


class CLIError(Exception):
    """A refused operation: printed as one line, exit code 1."""

    code = EXIT_FAILED


class UsageError(CLIError):
    """The arguments do not say what to do: exit code 2, as argparse's own errors."""

    code = EXIT_USAGE


class NotFound(CLIError):
    """No record (or entry) under that name: exit code 3, so a script can tell it from a
    store it could not read."""

    code = EXIT_NOT_FOUND


def emit(doc: dict[str, Any]) -> None:
    print(json.dumps({"schema": JSON_SCHEMA, **doc}, indent=2))


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def actor() -> str:
    """Who a CLI change is audited as (DESIGN.md §14): `cli:USER@HOST`."""
    user = os.environ.get("SUDO_USER") or os.environ.get("USER") or "operator"
    return f"cli:{user}@{socket.gethostname()}"


async def _audit(store: Store, zone: str, action: str, key: str = "", note: str = "") -> None:
    await store.audit_add(zone, ZoneAudit(store.now(), actor(), action, key, note))


def _config_path(args: argparse.Namespace) -> str:
    return getattr(args, "config", None) or os.environ.get("SMTPGUARD_CONFIG") or DEFAULT_CONFIG


def _config(args: argparse.Namespace) -> Config:
    return load(_config_path(args))


async def _with_store(config: Config, fn: Callable[[Store], Awaitable[T]], read_only: bool = False) -> T:
    password = read_secret(config.store.password_env, config.store.password_file, "store")
    store = store_from_url(config.store.url, password=password, read_only=read_only, create=False)
    await store.open()
    try:
        return await fn(store)
    finally:
        await store.close()


def _zone(config: Config, zone: str, allow_global: bool = False) -> str:
    if zone in config.zones or (allow_global and zone == "global"):
        return zone
    known = ", ".join(sorted(config.zones))
    raise CLIError(f"unknown zone {zone!r} (configured: {known})")


# --- commands --------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from smtpguard import logs, server
    from smtpguard.config import worker_count
    from smtpguard.workers import WorkerRole

    config = _config(args)
    role = WorkerRole.from_env()
    logs.configure(config.log.format, config.log.level, worker=role.index if role else None)
    if role is None and worker_count(config.workers) > 1:
        from smtpguard.supervisor import supervise

        return supervise(config, Path(_config_path(args)))
    server.serve(config, Path(_config_path(args)), role)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from smtpguard.config import provider_secrets, worker_count
    from smtpguard.verp import verp_key

    try:
        config = _config(args)
        provider_secrets(config)
        verp_key(config)  # serve reads it at start: a missing or empty one is refused here too
        if config.tls is not None:
            from smtpguard.server import tls_context

            tls_context(config)
        try:
            # Builds the backend without connecting: a redis:// store without the redis extra.
            store_from_url(config.store.url, create=False)
        except StoreUnavailable as e:
            raise ConfigError([f"store.url: {e}"]) from None
    except ConfigError as e:
        if args.json:
            emit({"ok": False, "config": _config_path(args), "problems": e.problems})
        raise
    summary = {
        "listeners": len(config.listen),
        "providers": len(config.providers),
        "zones": len(config.zones),
        "store": config.store.url.split("://")[0],
        "workers": worker_count(config.workers),
    }
    if args.json:
        emit({"ok": True, "config": _config_path(args), **summary})
        return 0
    print(
        f"config OK: {summary['listeners']} listener(s), {summary['providers']} provider(s), "
        f"{summary['zones']} zone(s), store {summary['store']}, {summary['workers']} worker(s)"
    )
    return 0


def cmd_healthcheck(args: argparse.Namespace) -> int:
    from smtpguard.metrics import local_health

    config = _config(args)
    listen = [(lst.host, lst.port, lst.tls) for lst in config.listen]
    metrics = None
    if config.metrics is not None:
        host, _, port = config.metrics.address.rpartition(":")
        metrics = (host.strip("[]"), int(port))
    ok, why = asyncio.run(local_health(listen, metrics))
    if args.json:
        emit({"ok": ok, "checked": why})
    elif not ok:
        print(f"smtpguard: unhealthy: {why}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


def cmd_hash_password(args: argparse.Namespace) -> int:
    from smtpguard.passwords import hash_password

    if sys.stdin.isatty():
        password = getpass.getpass("Password: ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise CLIError("empty password on stdin")
    print(hash_password(password))
    return 0


_TIMES = ("created_at", "updated_at", "next_attempt_at", "lease_until", "valid_until", "expires_at")


def history_json(rec: ledger.Record, events: Sequence[StoredEvent] = ()) -> dict[str, Any]:
    """The record as `history --json` prints it: the ledger's own fields, and the provider
    events that came back about it (§13), times in ISO 8601."""
    doc = rec.to_dict()
    doc["events"] = [{**e.to_dict(), "at": iso(e.at), "received_at": iso(e.received_at)} for e in events]
    for name in _TIMES:
        doc[name] = iso(doc[name])
    doc["class"] = doc.pop("lane")
    for a in doc["attempts"]:
        a["at"] = iso(a["at"])
        a["rejected"] = [{"address": addr, **reply} for addr, reply in a["rejected"]]
    for e in doc["audit"]:
        e["at"] = iso(e["at"])
    return doc


_LOOKUPS: dict[str, IdField] = {"id": "sg_id", "message_id": "message_id", "upstream_id": "upstream_id"}


def cmd_history(args: argparse.Namespace) -> int:
    config = _config(args)
    lookup = [(flag, getattr(args, flag)) for flag in _LOOKUPS if getattr(args, flag) is not None]
    if len(lookup) > 1 or (lookup and args.zone is not None) or (not lookup and args.key is None):
        raise UsageError("give ZONE KEY, or one of --id, --message-id, --upstream-id")

    async def read(store: Store) -> tuple[ledger.Record | None, list[StoredEvent]]:
        rec: ledger.Record | None
        if lookup:
            flag, value = lookup[0]
            # Records of zones no longer configured are shown too: history is the receipt.
            found = await store.find_records(_LOOKUPS[flag], value)
            if not found:
                raise NotFound(f"no record with {flag.replace('_', '-')} {value!r}")
            if len(found) > 1:
                names = ", ".join(f"{r.zone} {r.key}" for r in found[:10])
                raise CLIError(f"{len(found)} records have {flag.replace('_', '-')} {value!r}: {names}")
            rec = found[0]
        else:
            rec = await store.get(_zone(config, args.zone), args.key)
        if rec is None:
            return None, []
        return rec, await store.provider_events(rec.zone, rec.key)

    rec, events = asyncio.run(_with_store(config, read, read_only=True))
    if rec is None:
        raise NotFound(f"no record for zone {args.zone} key {args.key!r}")
    doc = history_json(rec, events)
    if args.json:
        emit(doc)
        return 0
    print(f"{doc['zone']} {doc['key']}: {doc['state']} (sg:{doc['sg_id']})")
    print(f"  created {doc['created_at']}  updated {doc['updated_at']}")
    if doc["class"]:
        print(
            f"  store-and-forward: class {doc['class']}, queued as {doc['queue_id']}, "
            f"never sent after {doc['expires_at']}"
        )
    if doc["next_attempt_at"]:
        print(f"  next attempt not before {doc['next_attempt_at']}")
    if doc["upstream_id"]:
        print(f"  upstream id {doc['upstream_id']}")
    for a in doc["attempts"]:
        code = f"{a['code']} {a['enhanced']}" if a["code"] else "-"
        print(
            f"  attempt {a['at']} {a['instance']} via {a['provider'] or '-'} [{a['phase']}] "
            f"{a['outcome']}: {code} {a['text']}"
        )
    for e in doc["audit"]:
        print(
            f"  audit {e['at']} {e['actor']} {e['action']}: {e['from_state']} -> {e['to_state']} {e['note']}"
        )
    for e in doc["events"]:
        status = f" {e['status']}" if e["status"] else ""
        print(
            f"  event {e['at']} {e['source']} {e['type']} ({e['provider_type']}){status} "
            f"{e['recipient'] or '-'}: {e['effect']}"
        )
    return 0


def _list_json(rec: ledger.Record) -> dict[str, Any]:
    last = rec.attempts[-1] if rec.attempts else None
    return {
        "zone": rec.zone,
        "key": rec.key,
        "state": rec.state.value,
        "created_at": iso(rec.created_at),
        "updated_at": iso(rec.updated_at),
        "sg_id": rec.sg_id,
        "message_id": rec.message_id,
        "upstream_id": rec.upstream_id,
        "provider": last.provider if last else None,
        "reply": rec.reply.to_dict() if rec.reply else None,
    }


async def list_records(
    store: Store,
    zones: Sequence[str],
    states: Sequence[str | None],
    since: float | None,
    provider: str | None,
    limit: int,
) -> list[ledger.Record]:
    """Newest first across zones and states: each (zone, state) list is read in pages from
    its index and the pages merged; a provider filter reads on until it has `limit`. A
    page ends where the next begins, inclusive, so records sharing an updated_at across
    the boundary are neither skipped nor listed twice."""
    page = max(limit, 50)
    found: list[ledger.Record] = []
    for zone in zones:
        for state in states:
            before: float | None = None
            seen: set[str] = set()
            taken = 0
            while taken < limit:
                upper = None if before is None else math.nextafter(before, math.inf)
                batch = [
                    r for r in await store.list_records(zone, state, since, upper, page) if r.key not in seen
                ]
                if not batch:
                    break
                for rec in batch:
                    seen.add(rec.key)
                    if provider is None or any(a.provider == provider for a in rec.attempts):
                        found.append(rec)
                        taken += 1
                before = batch[-1].updated_at
    found.sort(key=lambda r: r.updated_at, reverse=True)
    return found[:limit]


def cmd_list(args: argparse.Namespace) -> int:
    config = _config(args)
    zones = [_zone(config, args.zone)] if args.zone else sorted(config.zones)
    if args.limit < 1:
        raise UsageError("--limit must be at least 1")
    window = None
    if args.since:
        try:
            window = parse_duration(args.since)
        except ValueError as e:
            raise UsageError(f"--since: {e}") from None
    states: list[str | None] = list(dict.fromkeys(args.state)) if args.state else [None]

    async def run(store: Store) -> list[ledger.Record]:
        since = store.now() - window if window is not None else None
        return await list_records(store, zones, states, since, args.provider, args.limit)

    records = asyncio.run(_with_store(config, run, read_only=True))
    if args.json:
        emit({"records": [_list_json(r) for r in records]})
        return 0
    print(f"{'updated':20} {'zone':12} {'state':10} {'provider':10} key")
    for r in records:
        doc = _list_json(r)
        print(f"{doc['updated_at']:20} {r.zone:12} {r.state.value:10} {doc['provider'] or '-':10} {r.key}")
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    from smtpguard import logs
    from smtpguard.console import standalone

    config = _config(args)
    if config.console is None:
        raise CLIError("the config has no console: section")
    logs.configure(config.log.format, config.log.level)
    asyncio.run(standalone.run(config, _config_path(args)))
    return 0


def _operator_change(args: argparse.Namespace, change: desk.Change, action: str) -> int:
    """resolve, release, queue retry and queue drop: the console's code path (desk.py)."""
    config = _config(args)
    zone = _zone(config, args.zone)
    if not args.key:
        raise UsageError("a KEY is needed")

    async def run(store: Store) -> ledger.Record:
        try:
            return await desk.change_record(store, zone, args.key, change, actor(), action)
        except desk.NotFound as e:
            raise NotFound(str(e)) from None
        except desk.DeskError as e:
            raise CLIError(str(e)) from None

    new = asyncio.run(_with_store(config, run))
    if args.json:
        emit({"zone": zone, "key": args.key, "state": new.state.value, "sg_id": new.sg_id})
        return 0
    print(f"{zone} {args.key}: now {new.state.value}")
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    change = desk.decision_change(args.as_, actor(), args.force)
    return _operator_change(args, change, f"decide:{args.as_}")


def cmd_release(args: argparse.Namespace) -> int:
    return _operator_change(args, desk.decision_change("release", actor(), args.force), "decide:release")


def cmd_queue(args: argparse.Namespace) -> int:
    if args.action == "retry":
        return _operator_change(args, lambda r, now: ledger.retry_now(r, actor(), now), "queue:retry")
    if args.action == "drop":
        return _operator_change(args, lambda r, now: ledger.drop(r, actor(), now), "queue:drop")
    config = _config(args)
    zone = _zone(config, args.zone) if args.zone else None
    entries = asyncio.run(_with_store(config, lambda s: s.queue_entries(zone), read_only=True))
    if args.json:
        emit(
            {
                "entries": [
                    {
                        "zone": e.zone,
                        "key": e.key,
                        "class": e.lane,
                        "state": e.state,
                        "due_at": iso(e.due_at),
                        "claimed": e.claimed,
                        "enqueued_at": iso(e.enqueued_at),
                        "size": e.size,
                    }
                    for e in entries
                ]
            }
        )
        return 0
    print(f"{'zone':12} {'class':13} {'state':10} {'due':21} {'size':>8}  key")
    for e in entries:
        due = "held" if e.due_at is None else ("claimed" if e.claimed else iso(e.due_at) or "-")
        print(f"{e.zone:12} {e.lane:13} {e.state:10} {due:21} {e.size:>8}  {e.key}")
    return 0


def cmd_pause(args: argparse.Namespace, paused: bool = True) -> int:
    config = _config(args)
    zone = _zone(config, args.zone)
    message_class = getattr(args, "message_class", None)
    if message_class is not None:
        return _pause_class(config, zone, _class(config, message_class), paused, args.json)

    async def run(store: Store) -> None:
        await store.set_paused(zone, paused)
        await _audit(store, zone, "pause" if paused else "resume")

    asyncio.run(_with_store(config, run))
    if args.json:
        emit({"zone": zone, "paused": paused})
        return 0
    print(f"zone {zone} {'paused' if paused else 'resumed'}")
    return 0


def _class(config: Config, name: str) -> str:
    # Classes are matched as the class header is (submission.message_class): lowercased.
    wanted = name.strip().lower()
    if wanted in config.queue.classes:
        return wanted
    known = ", ".join(sorted(config.queue.classes))
    raise UsageError(f"unknown message class {name!r} (configured: {known})")


def _pause_class(config: Config, zone: str, message_class: str, paused: bool, as_json: bool) -> int:
    """DESIGN.md §16: one class of the zone held on every instance within a second."""

    async def run(store: Store) -> None:
        await store.set_class_paused(zone, message_class, paused)
        await _audit(store, zone, "pause:class" if paused else "resume:class", message_class)
        if not paused:
            # Queued entries held while paused come back now, not when their hold ends; once
            # more after every instance has read the resume, for an entry an instance held
            # on its last look at the pause.
            await class_pauses.wake_held(store, zone, message_class, store.now())
            await asyncio.sleep(class_pauses.REFRESH * 2)
            await class_pauses.wake_held(store, zone, message_class, store.now())

    asyncio.run(_with_store(config, run))
    if as_json:
        emit({"zone": zone, "class": message_class, "paused": paused})
        return 0
    print(f"class {message_class} of zone {zone} {'paused' if paused else 'resumed'}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    return cmd_pause(args, paused=False)


def _address(value: str) -> str:
    addr = normalize_address(value)
    problem = address_problem(addr)
    if problem:
        raise CLIError(f"bad address {value!r}: {problem}")
    return addr


def cmd_suppress(args: argparse.Namespace) -> int:
    config = _config(args)
    zone = _zone(config, args.zone, allow_global=True)
    now = time.time()
    if args.action == "add":
        addr = _address(args.address)

        async def add(store: Store) -> bool:
            added = await store.suppress_add(zone, addr, args.reason or "added by operator", now)
            await _audit(store, zone, "suppress:add", addr, args.reason or "")
            return added

        added = asyncio.run(_with_store(config, add))
        if args.json:
            emit({"zone": zone, "address": addr, "added": added})
        else:
            print(f"{addr} {'added to' if added else 'already on'} the {zone} suppression list")
    elif args.action == "remove":
        addr = _address(args.address)

        async def remove(store: Store) -> bool:
            removed = await store.suppress_remove(zone, addr)
            if removed:
                await _audit(store, zone, "suppress:remove", addr)
            return removed

        removed = asyncio.run(_with_store(config, remove))
        if not removed:
            raise NotFound(f"{addr} is not on the {zone} suppression list")
        if args.json:
            emit({"zone": zone, "address": addr, "removed": True})
        else:
            print(f"{addr} removed from the {zone} suppression list")
    elif args.action == "import":
        rows = _read_csv(Path(args.file))

        async def imp(store: Store) -> int:
            n = 0
            for addr, reason in rows:
                n += await store.suppress_add(zone, addr, reason, now)
            await _audit(store, zone, "suppress:import", "", f"{n} new of {len(rows)} from {args.file}")
            return n

        n = asyncio.run(_with_store(config, imp))
        if args.json:
            emit({"zone": zone, "rows": len(rows), "added": n})
        else:
            print(f"imported {n} new address(es) of {len(rows)} into the {zone} suppression list")
    else:
        entries = asyncio.run(_with_store(config, lambda s: s.suppress_list(zone), read_only=True))
        if args.action == "list" and args.json:
            emit(
                {
                    "entries": [
                        {"zone": e.zone, "address": e.address, "reason": e.reason, "at": iso(e.at)}
                        for e in entries
                    ]
                }
            )
        else:
            out = io.StringIO()
            w = csv.writer(out, lineterminator="\n")
            w.writerow(["address", "reason", "at"])
            for e in entries:
                w.writerow([e.address, e.reason, iso(e.at)])
            sys.stdout.write(out.getvalue())
    return 0


def _read_csv(path: Path) -> list[tuple[str, str]]:
    try:
        # utf-8-sig: spreadsheet exports start with a byte-order mark, which would otherwise
        # glue itself to the first address (or hide the header row).
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise CLIError(f"{path}: not UTF-8 text (byte {e.start}); save the CSV as UTF-8") from None
    rows: list[tuple[str, str]] = []
    for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not row or not row[0].strip() or row[0].strip().lower() in ("address", "email"):
            continue
        addr = normalize_address(row[0])
        problem = address_problem(addr)
        if problem:
            raise CLIError(f"{path}:{lineno}: bad address {row[0]!r}: {problem}")
        rows.append((addr, row[1].strip() if len(row) > 1 and row[1].strip() else "imported"))
    return rows


def cmd_stats(args: argparse.Namespace) -> int:
    config = _config(args)
    zones = [_zone(config, args.zone)] if args.zone else sorted(config.zones)
    now = time.time()

    async def gather(store: Store) -> list[dict[str, Any]]:
        paused_classes = await store.paused_classes()
        depth: dict[str, dict[str, int]] = {}
        for e in await store.queue_entries(None):
            lane = depth.setdefault(e.zone, {})
            lane[e.lane] = lane.get(e.lane, 0) + 1
        out = []
        for z in zones:
            zc = config.zones[z]
            caps = caps_for(zc.plan, zc.hourly_cap, zc.monthly_cap)
            counts = await store.counts(z)
            usage = await store.cap_usage(z, now, month_of(now))
            capped = [u.username for u in zc.users if u.hourly_cap is not None or u.monthly_cap is not None]
            users = await store.user_cap_usage(z, capped, now, month_of(now))
            out.append(
                {
                    "zone": z,
                    "sent": counts.get("sent", 0),
                    "duplicates": counts.get("duplicate", 0),
                    "deferred": counts.get("deferred", 0),
                    "failed": counts.get("failed", 0),
                    "unknown": counts.get("unknown", 0),
                    "rejected": {
                        k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("rejected:")
                    },
                    "held": {
                        k: v
                        for k, v in sorted(counts.items())
                        if k
                        in (
                            "paused",
                            "cap_hour",
                            "cap_month",
                            "user_cap_hour",
                            "user_cap_month",
                            "in_flight",
                            "too_soon",
                            "failed_held",
                            "unknown_held",
                            "reused",
                        )
                    },
                    "cap": {
                        "hour": {"used": usage.hour, "limit": caps.hourly},
                        "month": {"used": usage.month, "limit": caps.monthly},
                    },
                    "user_caps": _user_caps(zc, caps, users),
                    "paused": zc.paused or await store.is_paused(z),
                    "paused_classes": sorted(c for pz, c in paused_classes if pz == z),
                    "queue": depth.get(z, {}),
                    "suppressed": len(await store.suppress_list(z)),
                    # DESIGN.md §16: the zone's own route, else the top-level one
                    "route": zc.providers or [p.name for p in config.providers],
                }
            )
        return out

    async def gather_all(
        store: Store,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, str | None]]:
        probes = {(p.instance, p.provider): p for p in await store.probes()}
        circuits = []
        for c in await store.circuits():
            probe = probes.get((c.instance, c.provider))
            circuits.append(
                {
                    "instance": c.instance,
                    "provider": c.provider,
                    "circuit": c.circuit,
                    "since": iso(c.at),
                    # DESIGN.md §12: the last probe's verdict; null when the provider is not probed
                    "ready": probe.ready if probe else None,
                    "probe": probe.detail if probe else None,
                    "probed_at": iso(probe.at) if probe else None,
                }
            )
        # DESIGN.md §16: providers every instance keeps off after a rate-limit reply
        throttled = {name: iso(until) for name, until in sorted((await store.throttled(now)).items())}
        return await gather(store), circuits, throttled

    rows, circuits, throttled = asyncio.run(_with_store(config, gather_all, read_only=True))
    if args.json:
        emit({"zones": rows, "providers": circuits, "throttled": throttled})
        return 0
    print(
        f"{'zone':16} {'sent':>7} {'dups':>6} {'rejected':>8} {'hour':>9} {'month':>13} "
        f"{'paused':>6} {'suppr':>5}"
    )
    for r in rows:
        hour = f"{r['cap']['hour']['used']}/{r['cap']['hour']['limit']}"
        month = f"{r['cap']['month']['used']}/{r['cap']['month']['limit']}"
        print(
            f"{r['zone']:16} {r['sent']:>7} {r['duplicates']:>6} "
            f"{sum(r['rejected'].values()):>8} {hour:>9} {month:>13} "
            f"{'yes' if r['paused'] else 'no':>6} {r['suppressed']:>5}"
        )
        if r["paused_classes"]:
            print(f"  paused classes: {', '.join(r['paused_classes'])}")
        for u in r["user_caps"]:
            print(
                f"  user {u['username']}: hour {u['hour']['used']}/{u['hour']['limit']}, "
                f"month {u['month']['used']}/{u['month']['limit']}"
            )
    for c in circuits:
        ready = "" if c["ready"] is None else f"; {'ready' if c['ready'] else 'NOT READY'} ({c['probe']})"
        where = f"provider {c['provider']} on {c['instance']}"
        print(f"{where}: circuit {c['circuit']} since {c['since']}{ready}")
    for name, until in throttled.items():
        print(f"provider {name}: throttled (rate-limit reply) until {until}")
    for r in rows:
        if config.zones[r["zone"]].providers is not None:
            print(f"zone {r['zone']}: own route {', '.join(r['route'])}")
    return 0


def _user_caps(zc: ZoneConfig, caps: Caps, usage: dict[str, CapUsage]) -> list[dict[str, Any]]:
    """Each user with caps of its own (DESIGN.md §16): its use of them now."""
    out = []
    for user in zc.users:
        own = user_caps_for(caps, user.hourly_cap, user.monthly_cap)
        if own is None:
            continue
        used = usage.get(user.username, CapUsage(0, 0))
        out.append(
            {
                "username": user.username,
                "hour": {"used": used.hour, "limit": own.hourly},
                "month": {"used": used.month, "limit": own.monthly},
            }
        )
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    """DESIGN.md §12. Exit 0 no check is an error, 1 one is, 2 bad config or usage."""
    from smtpguard.readiness import doctor

    try:
        config = _config(args)
    except ConfigError as e:
        for problem in e.problems:
            print(f"smtpguard: {problem}", file=sys.stderr)
        return 2
    if args.zone is not None and args.zone not in config.zones:
        known = ", ".join(sorted(config.zones))
        print(f"smtpguard: unknown zone {args.zone!r} (configured: {known})", file=sys.stderr)
        return 2
    helo = config.hostname or socket.getfqdn()
    try:
        findings = asyncio.run(doctor.run(config, args.zone, probes=not args.no_probe, helo=helo))
    except Exception as e:
        # A check that breaks is a bug to report, not a traceback for the operator.
        what = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        print(f"smtpguard: doctor could not finish: {what}", file=sys.stderr)
        if args.json:
            emit({"ok": False, "error": f"doctor could not finish: {what}", "checks": []})
        return 2
    ok = all(f.status != "error" for f in findings)
    if args.json:
        emit({"ok": ok, "checks": [f.to_dict() for f in findings]})
    else:
        print(doctor.render_table(findings))
    return 0 if ok else 1


def cmd_sink(args: argparse.Namespace) -> int:
    from smtpguard import sink

    asyncio.run(sink.run(args.listen, Path(args.maildir)))
    return 0


# --- parser ----------------------------------------------------------------------------------
class _Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands whose options and positionals may come in any order, as the docs write
    them (`queue list -c FILE ZONE`): stock argparse stops at the first option and reads
    ZONE as an extra argument."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        name, rest = values[0], list(values[1:])
        sub = self.choices.get(name)
        if sub is None:
            super().__call__(parser, namespace, values, option_string)
            return
        if self.dest is not argparse.SUPPRESS:
            setattr(namespace, self.dest, name)
        try:
            if "--" in rest:
                subns, extra = sub.parse_known_args(_positionals_last(sub, rest))
            else:
                subns, extra = sub.parse_known_intermixed_args(rest)
        except TypeError:
            # A command with subcommands of its own cannot be parsed intermixed.
            subns, extra = sub.parse_known_args(rest)
        for key, value in vars(subns).items():
            setattr(namespace, key, value)
        if extra:
            sub.error(f"unrecognized arguments: {' '.join(extra)}")


def _positionals_last(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`args` with everything after the first `--` kept as positionals (a key or an address
    may start with '-'): options before it first, then `--`, then the positionals before it,
    then those after. (Intermixed parsing ignores `--` on Python 3.11.)"""
    cut = args.index("--")
    before, after = args[:cut], args[cut + 1 :]
    options: list[str] = []
    positionals: list[str] = []
    i = 0
    while i < len(before):
        token = before[i]
        i += 1
        if not token.startswith("-") or token == "-":
            positionals.append(token)
            continue
        options.append(token)
        action = parser._option_string_actions.get(token)
        if action is not None and action.nargs != 0 and i < len(before):
            options.append(before[i])  # the option's value, whatever it looks like
            i += 1
    return [*options, "--", *positionals, *after]


_EPILOG = (
    "exit codes:\n"
    + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())
    + (
        f"\n\nThe config is -c FILE (before or after the command), else $SMTPGUARD_CONFIG, else "
        f"{DEFAULT_CONFIG}; the CLI works on the store named there. --json output is an object "
        f'with "schema": {JSON_SCHEMA}. See docs/runbook.md.'
    )
)
_DOCTOR_EPILOG = (
    "exit codes:\n"
    "  0  no check is an error (warnings allowed)\n"
    "  1  at least one check is an error\n"
    "  2  bad config, unknown zone or bad usage\n\n" + _EPILOG.split("\n\n", 1)[1]
)
_CONFIG_HELP = f"config file (default: $SMTPGUARD_CONFIG, else {DEFAULT_CONFIG})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smtpguard",
        description="Idempotent SMTP submission proxy: one upstream 250 per business event.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.register("action", "parsers", _Commands)
    p.add_argument("--version", action="version", version=f"smtpguard {__version__}")
    p.add_argument("-c", "--config", help=_CONFIG_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(
        name: str,
        fn: Callable[[argparse.Namespace], int],
        help_: str,
        description: str,
        config: bool = True,
        json_: bool = True,
        epilog: str = _EPILOG,
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(
            name,
            help=help_,
            description=description,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if config:
            # SUPPRESS: a -c given before the command is not reset by this one's default.
            sp.add_argument("-c", "--config", default=argparse.SUPPRESS, help=_CONFIG_HELP)
        if json_:
            sp.add_argument("--json", action="store_true", help=f"print a JSON object (schema {JSON_SCHEMA})")
        sp.set_defaults(fn=fn, json=False)
        return sp

    cmd(
        "serve",
        cmd_serve,
        "run the proxy",
        "Run the listeners, the relay and the store-and-forward worker until SIGTERM "
        "(graceful drain); SIGHUP reloads the config and re-reads the TLS files. With "
        "`workers: N` (or auto: one per core) in the config, a supervisor runs N such "
        "processes on the same listening sockets, restarts one that dies, and passes "
        "SIGHUP and SIGTERM on to all of them.",
        json_=False,
    )
    cmd(
        "check-config",
        cmd_check_config,
        "validate the config",
        "Validate the config as serve would: every problem with its YAML path and line, "
        "provider secrets present, TLS files loadable. Exit 0 when serve would accept it.",
    )
    cmd(
        "healthcheck",
        cmd_healthcheck,
        "is the local instance up (for container health checks)",
        "Ask the instance on this machine whether it is up: /healthz when the config has "
        "`metrics:`, else the first listener's SMTP greeting. Exit 0 healthy, 1 not.",
    )
    cmd(
        "hash-password",
        cmd_hash_password,
        "read a password on stdin, print its hash",
        "Read one password line on stdin (prompted on a terminal) and print the argon2 hash "
        "for a user's password_hash.",
        config=False,
        json_=False,
    )
    sp = cmd(
        "history",
        cmd_history,
        "show an event's record and attempts",
        "Show the ledger record of one event: state, every attempt (provider, reply, "
        "upstream id), the operator audit and the provider events. Name it by ZONE KEY, or "
        "find it by the smtpguard id of a reply ([sg:ID]), its Message-ID or the provider's "
        "queue id. Read-only. Exit 3 when there is no record.",
    )
    sp.add_argument("zone", nargs="?", help="the zone the event was submitted in")
    sp.add_argument("key", nargs="?", help="the event key (X-Event-Key)")
    sp.add_argument("--id", help="the smtpguard id in a reply: 250 2.0.0 [sg:ID] …")
    sp.add_argument("--message-id", dest="message_id", help="the message's Message-ID (with or without <>)")
    sp.add_argument("--upstream-id", dest="upstream_id", help="the provider's id from its 250 (queued as …)")
    sp = cmd(
        "list",
        cmd_list,
        "list records, newest first",
        "List the ledger records of a zone (or of every zone), newest first: by state "
        "(--state unknown --state failed for the held ones), updated since a time ago, "
        "relayed through a provider. Read-only.",
    )
    sp.add_argument("zone", nargs="?", help="one zone (default: every zone)")
    sp.add_argument("--state", action="append", choices=[s.value for s in ledger.State], help="repeatable")
    sp.add_argument("--since", help="only records updated within this long (24h, 30m, 7d)")
    sp.add_argument("--provider", help="only records with an attempt through this provider")
    sp.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    sp = cmd(
        "console",
        cmd_console,
        "run the operator's console alone",
        "Run the browser console of the config's `console:` section against its store, "
        "without the proxy (on another host, say). serve runs it too when configured. "
        "SIGHUP re-reads the file: operators, hashes and roles apply at once.",
        json_=False,
    )
    sp = cmd(
        "resolve",
        cmd_resolve,
        "close an unknown outcome",
        "Close an `unknown` outcome after asking the provider: --as delivered (duplicates "
        "are answered 250) or --as retry (the client's next retry is sent). Audited.",
    )
    sp.add_argument("zone")
    sp.add_argument("key")
    sp.add_argument("--as", dest="as_", required=True, choices=["delivered", "retry"])
    sp.add_argument(
        "--force",
        action="store_true",
        help="retry even while the owner that lost its lease may still be sending (risks a second copy)",
    )
    sp = cmd(
        "release",
        cmd_release,
        "allow one new attempt of a failed event",
        "Allow one new attempt of a `failed` event (after fixing what the 5xx said). Audited.",
    )
    sp.add_argument("zone")
    sp.add_argument("key")
    sp.add_argument(
        "--force",
        action="store_true",
        help="release even while an owner that lost its lease may still be sending (risks a second copy)",
    )
    for name, fn in (("pause", cmd_pause), ("resume", cmd_resume)):
        sp = cmd(
            name,
            fn,
            f"{name} a zone on every instance",
            f"{name.capitalize()} a zone through the store, on every instance at once. Paused, "
            "new events get 451 4.7.0 and duplicates still get their 250. With --class, only "
            "that message class (the class header) of the zone, within a second; queue mode "
            "holds the class's entries instead.",
        )
        sp.add_argument("zone")
        sp.add_argument(
            "--class", dest="message_class", metavar="CLASS", help=f"{name} one message class only"
        )
    sp = cmd(
        "suppress",
        cmd_suppress,
        "manage suppression lists",
        "Suppression lists: add, remove, list, import FILE.csv (address[,reason]; a UTF-8 "
        "BOM is fine), export (CSV). ZONE `global` is the list every zone shares.",
    )
    sp.add_argument("action", choices=["add", "remove", "list", "import", "export"])
    sp.add_argument("zone", help="a zone, or 'global'")
    sp.add_argument("address", nargs="?", help="address (add/remove) or CSV file (import)")
    sp.add_argument("--reason", help="why the address is listed (add)")
    sp = cmd(
        "queue",
        cmd_queue,
        "the store-and-forward queue",
        "The store-and-forward queue (delivery: queue): list [ZONE], retry ZONE KEY (now), "
        "drop ZONE KEY (never send; audited).",
    )
    sp.add_argument("action", choices=["list", "retry", "drop"])
    sp.add_argument("zone", nargs="?")
    sp.add_argument("key", nargs="?")
    sp = cmd(
        "stats",
        cmd_stats,
        "sends, duplicates, rejections and cap use per zone",
        "Totals per zone since the store was created (sent, duplicates, rejections, held) "
        "with live cap use, queue depth and each instance's provider circuits. Read-only.",
    )
    sp.add_argument("zone", nargs="?")
    sp = cmd(
        "doctor",
        cmd_doctor,
        "check DNS (SPF, DKIM, DMARC, MX) and probe every provider",
        "Readiness (DESIGN.md §12): per zone, sender domain and provider, the SPF include "
        "tree, DKIM selectors, DMARC, MX; per provider a probe (connect, EHLO, STARTTLS with "
        "certificate checks, AUTH, QUIT; never MAIL). Exit 0 when no check is an error, 1 "
        "when one is, 2 for a bad config.",
        epilog=_DOCTOR_EPILOG,
    )
    sp.add_argument("--zone", help="check this zone only")
    sp.add_argument("--no-probe", action="store_true", help="DNS checks only; no provider connection")
    sp = cmd(
        "sink",
        cmd_sink,
        "a local test upstream writing to a Maildir",
        "A local SMTP upstream for demos and staging: accepts everything, writes each "
        "message to MAILDIR/new under a name that is never reused.",
        config=False,
        json_=False,
    )
    sp.add_argument("--listen", default="127.0.0.1:2525", help="host:port (default 127.0.0.1:2525)")
    sp.add_argument("--maildir", default="var/sink", help="the Maildir to write (default var/sink)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "command", None) == "suppress":
        if args.action in ("add", "remove", "import") and not args.address:
            parser.error(
                f"suppress {args.action} needs an address"
                + (" (a CSV file)" if args.action == "import" else "")
            )
        if args.action == "import":
            args.file = args.address
    if (
        getattr(args, "command", None) == "queue"
        and args.action in ("retry", "drop")
        and not (args.zone and args.key)
    ):
        parser.error(f"queue {args.action} needs ZONE and KEY")
    try:
        code: int = args.fn(args)
        return code
    except ConfigError as e:
        for problem in e.problems:
            print(f"smtpguard: {problem}", file=sys.stderr)
        return EXIT_FAILED
    except CLIError as e:
        print(f"smtpguard: {e}", file=sys.stderr)
        return e.code
    except StoreMissing as e:
        print(f"smtpguard: {e}", file=sys.stderr)
        return EXIT_STORE
    except StoreUnavailable as e:
        print(f"smtpguard: store unavailable: {e}", file=sys.stderr)
        return EXIT_STORE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `smtpguard suppress export ZONE | head`: the reader has what it wanted. Nothing to
        # say, and nothing left to flush at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        # The path is what an operator needs to fix it: "Permission denied" alone is not.
        where = f"{e.filename}: " if e.filename else ""
        print(f"smtpguard: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_FAILED
