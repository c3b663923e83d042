"""Commands on a zone: pause and resume (whole or one class), suppression lists, stats."""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from smtpguard import desk
from smtpguard.cli.context import CLIError, NotFound, UsageError, _config, _zone, actor, emit, iso, on_store
from smtpguard.config import Config
from smtpguard.policy import receivers
from smtpguard.policy.senders import address_problem, normalize_address
from smtpguard.store import Store


def cmd_pause(args: argparse.Namespace, paused: bool = True) -> int:
    """The zone, one class of it (DESIGN.md §16) or its recipients of one receiving provider
    (§21), held or let go on every instance (within a second for a class or a receiver)."""
    config = _config(args)
    zone = _zone(config, args.zone)
    message_class = getattr(args, "message_class", None)
    receiver = getattr(args, "receiver", None)
    if message_class is not None and receiver is not None:
        raise UsageError("give --class or --receiver, not both")
    part: tuple[str, str] | None = None  # ("class", CLASS) or ("receiver", RECEIVER)
    if message_class is not None:
        part = ("class", _class(config, message_class))
    elif receiver is not None:
        part = ("receiver", _receiver(config, receiver, paused))

    def change(store: Store) -> Awaitable[None]:
        if part is None:
            return desk.set_zone_paused(store, zone, paused, actor())
        kind, name = part
        set_paused = desk.set_class_paused if kind == "class" else desk.set_receiver_paused
        return set_paused(store, zone, name, paused, actor())

    on_store(config, change)
    doc = {"zone": zone} if part is None else {"zone": zone, part[0]: part[1]}
    if args.json:
        emit({**doc, "paused": paused})
        return 0
    what = f"zone {zone}" if part is None else f"{part[0]} {part[1]} of zone {zone}"
    print(f"{what} {'paused' if paused else 'resumed'}")
    return 0


def _class(config: Config, name: str) -> str:
    # Classes are matched as the class header is (submission.message_class): lowercased.
    wanted = name.strip().lower()
    if wanted in config.queue.classes:
        return wanted
    known = ", ".join(sorted(config.queue.classes))
    raise UsageError(f"unknown message class {name!r} (configured: {known})")


def _receiver(config: Config, name: str, paused: bool) -> str:
    wanted = name.strip().lower()
    known = {*config.receiver_table(), receivers.OTHER}
    if paused and config.receivers is None and not any(z.receivers for z in config.zones.values()):
        # Off, serve looks no recipient's MX up: the pause would be stored, said to be done,
        # and hold nothing. (resume is let through: it only lets go of a pause stored before.)
        raise UsageError(
            "receivers are off in this config (no top-level `receivers:` and no zone has one), "
            "so no recipient is matched to a receiver and a pause would hold nothing: "
            "add `receivers: {}` and reload first"
        )
    if wanted in known:
        return wanted
    raise UsageError(f"unknown receiver {name!r} (configured: {', '.join(sorted(known))})")


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
    if args.action == "add":
        addr = _address(args.address)

        def add(store: Store) -> Awaitable[bool]:
            reason = args.reason or "added by operator"
            return desk.suppress_add(store, zone, addr, reason, actor(), args.reason or "")

        added = on_store(config, add)
        if args.json:
            emit({"zone": zone, "address": addr, "added": added})
        else:
            print(f"{addr} {'added to' if added else 'already on'} the {zone} suppression list")
    elif args.action == "remove":
        addr = _address(args.address)

        removed = on_store(config, lambda store: desk.suppress_remove(store, zone, addr, actor()))
        if not removed:
            raise NotFound(f"{addr} is not on the {zone} suppression list")
        if args.json:
            emit({"zone": zone, "address": addr, "removed": True})
        else:
            print(f"{addr} removed from the {zone} suppression list")
    elif args.action == "import":
        rows = _read_csv(Path(args.file))

        n = on_store(config, lambda store: desk.suppress_import(store, zone, rows, actor(), args.file))
        if args.json:
            emit({"zone": zone, "rows": len(rows), "added": n})
        else:
            print(f"imported {n} new address(es) of {len(rows)} into the {zone} suppression list")
    else:
        entries = on_store(config, lambda s: s.suppress_list(zone), read_only=True)
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

    async def gather_all(
        store: Store,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, str | None]]:
        circuits, throttled = await desk.provider_stats(store)
        for c in circuits:
            c["since"], c["probed_at"] = iso(c["since"]), iso(c["probed_at"])
        return (
            await desk.zone_stats(config, store, zones),
            circuits,
            {n: iso(t) for n, t in throttled.items()},
        )

    rows, circuits, throttled = on_store(config, gather_all, read_only=True)
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
        for paused in ("classes", "receivers"):
            if names := r[f"paused_{paused}"]:
                print(f"  paused {paused}: {', '.join(names)}")
        for name, c in r["receivers"].items():
            print(
                f"  receiver {name}: sent {c['sent']}, delivered {c['delivered']}, deferred "
                f"{c['deferred']}, bounces {c['bounce']}, complaints {c['complaint']}"
            )
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
