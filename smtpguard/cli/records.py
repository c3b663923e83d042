"""Commands on ledger records: history, list, resolve, release and the queue."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from smtpguard import desk
from smtpguard.cli.context import CLIError, NotFound, UsageError, _config, _zone, actor, emit, iso, on_store
from smtpguard.policy import ledger
from smtpguard.store import Store
from smtpguard.store.base import IdField, StoredEvent
from smtpguard.units import parse_duration

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

    rec, events = on_store(config, read, read_only=True)
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
    for label, name in (("next attempt not before", "next_attempt_at"), ("upstream id", "upstream_id")):
        if doc[name]:
            print(f"  {label} {doc[name]}")
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

    records = on_store(config, run, read_only=True)
    if args.json:
        emit({"records": [_list_json(r) for r in records]})
        return 0
    print(f"{'updated':20} {'zone':12} {'state':10} {'provider':10} key")
    for r in records:
        doc = _list_json(r)
        print(f"{doc['updated_at']:20} {r.zone:12} {r.state.value:10} {doc['provider'] or '-':10} {r.key}")
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

    new = on_store(config, run)
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
    entries = on_store(config, lambda s: s.queue_entries(zone), read_only=True)
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
