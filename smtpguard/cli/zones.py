"""Commands on a zone: pause and resume (whole or one class), suppression lists, stats."""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import sys
import time
from pathlib import Path
from typing import Any

from smtpguard import class_pauses
from smtpguard.cli.context import (
    CLIError,
    NotFound,
    UsageError,
    _audit,
    _config,
    _with_store,
    _zone,
    emit,
    iso,
)
from smtpguard.config import Config, ZoneConfig
from smtpguard.policy.limits import Caps, caps_for, month_of, user_caps_for
from smtpguard.policy.senders import address_problem, normalize_address
from smtpguard.store import Store
from smtpguard.store.base import CapUsage


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
