"""`smtpguard …`: the only place that turns errors into exit codes (DESIGN.md §8).

Exit codes: 0 success, 1 a refused or failed operation (bad config, unknown key, a state
that does not allow the command), 2 bad usage. Errors are one line on stderr, never a
traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import getpass
import io
import json
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from smtpguard import __version__
from smtpguard.config import DEFAULT_CONFIG, Config, ConfigError, load, read_secret
from smtpguard.policy import ledger
from smtpguard.policy.limits import caps_for, month_of
from smtpguard.policy.queue import queue_due
from smtpguard.policy.senders import address_problem, normalize_address
from smtpguard.store import Store, StoreUnavailable, store_from_url
from smtpguard.store.base import StoredEvent

T = TypeVar("T")


class CLIError(Exception):
    """A refused operation: printed as one line, exit code 1."""


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def actor() -> str:
    user = os.environ.get("SUDO_USER") or os.environ.get("USER") or "operator"
    return f"{user}@{socket.gethostname()}"


def _config(args: argparse.Namespace) -> Config:
    path = args.config or os.environ.get("SMTPGUARD_CONFIG") or DEFAULT_CONFIG
    return load(path)


async def _with_store(config: Config, fn: Callable[[Store], Awaitable[T]]) -> T:
    password = read_secret(config.store.password_env, config.store.password_file, "store")
    store = store_from_url(config.store.url, password=password)
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

    config = _config(args)
    logs.configure(config.log.format, config.log.level)
    path = Path(args.config or os.environ.get("SMTPGUARD_CONFIG") or DEFAULT_CONFIG)
    server.serve(config, path)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from smtpguard.config import provider_secrets

    config = _config(args)
    provider_secrets(config)
    if config.tls is not None:
        from smtpguard.server import tls_context

        tls_context(config)
    print(
        f"config OK: {len(config.listen)} listener(s), {len(config.providers)} provider(s), "
        f"{len(config.zones)} zone(s), store {config.store.url.split('://')[0]}"
    )
    return 0


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


def cmd_history(args: argparse.Namespace) -> int:
    config = _config(args)
    zone = _zone(config, args.zone)

    async def read(store: Store) -> tuple[ledger.Record | None, list[StoredEvent]]:
        rec = await store.get(zone, args.key)
        return rec, (await store.provider_events(zone, args.key) if rec is not None else [])

    rec, events = asyncio.run(_with_store(config, read))
    if rec is None:
        raise CLIError(f"no record for zone {zone} key {args.key!r}")
    doc = history_json(rec, events)
    if args.json:
        print(json.dumps(doc, indent=2))
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


def _operator_change(
    args: argparse.Namespace, change: Callable[[ledger.Record, float], ledger.Record]
) -> int:
    config = _config(args)
    zone = _zone(config, args.zone)

    async def run(store: Store) -> ledger.Record:
        for _ in range(10):
            rec = await store.get(zone, args.key)
            if rec is None:
                raise CLIError(f"no record for zone {zone} key {args.key!r}")
            try:
                new = change(rec, store.now())
            except ledger.OperatorRefused as e:
                raise CLIError(str(e)) from None
            if rec.lane is not None:
                # Store-and-forward: the queue entry moves with the record, atomically.
                written = await store.requeue(new, rec.version, queue_due(new))
            else:
                written = await store.put(new, rec.version)
            if written is None:
                return new
        raise CLIError("the record kept changing; try again")

    new = asyncio.run(_with_store(config, run))
    print(f"{zone} {args.key}: now {new.state.value}")
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    return _operator_change(args, lambda r, now: ledger.resolve(r, args.as_, actor(), now, args.force))


def cmd_release(args: argparse.Namespace) -> int:
    return _operator_change(args, lambda r, now: ledger.release(r, actor(), now, args.force))


def cmd_queue(args: argparse.Namespace) -> int:
    if args.action == "retry":
        return _operator_change(args, lambda r, now: ledger.retry_now(r, actor(), now))
    if args.action == "drop":
        return _operator_change(args, lambda r, now: ledger.drop(r, actor(), now))
    config = _config(args)
    zone = _zone(config, args.zone) if args.zone else None
    entries = asyncio.run(_with_store(config, lambda s: s.queue_entries(zone)))
    if args.json:
        print(
            json.dumps(
                [
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
                ],
                indent=2,
            )
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
    asyncio.run(_with_store(config, lambda s: s.set_paused(zone, paused)))
    print(f"zone {zone} {'paused' if paused else 'resumed'}")
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
        added = asyncio.run(
            _with_store(
                config,
                lambda s: s.suppress_add(zone, addr, args.reason or "added by operator", now),
            )
        )
        print(f"{addr} {'added to' if added else 'already on'} the {zone} suppression list")
    elif args.action == "remove":
        addr = _address(args.address)
        removed = asyncio.run(_with_store(config, lambda s: s.suppress_remove(zone, addr)))
        if not removed:
            raise CLIError(f"{addr} is not on the {zone} suppression list")
        print(f"{addr} removed from the {zone} suppression list")
    elif args.action == "import":
        rows = _read_csv(Path(args.file))

        async def imp(store: Store) -> int:
            n = 0
            for addr, reason in rows:
                n += await store.suppress_add(zone, addr, reason, now)
            return n

        n = asyncio.run(_with_store(config, imp))
        print(f"imported {n} new address(es) of {len(rows)} into the {zone} suppression list")
    else:
        entries = asyncio.run(_with_store(config, lambda s: s.suppress_list(zone)))
        if args.action == "list" and args.json:
            print(
                json.dumps(
                    [
                        {"zone": e.zone, "address": e.address, "reason": e.reason, "at": iso(e.at)}
                        for e in entries
                    ],
                    indent=2,
                )
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
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror}") from None
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
                    "paused": zc.paused or await store.is_paused(z),
                    "queue": depth.get(z, {}),
                    "suppressed": len(await store.suppress_list(z)),
                }
            )
        return out

    async def gather_all(store: Store) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
        return await gather(store), circuits

    rows, circuits = asyncio.run(_with_store(config, gather_all))
    if args.json:
        print(json.dumps({"zones": rows, "providers": circuits}, indent=2))
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
    for c in circuits:
        ready = "" if c["ready"] is None else f"; {'ready' if c['ready'] else 'NOT READY'} ({c['probe']})"
        where = f"provider {c['provider']} on {c['instance']}"
        print(f"{where}: circuit {c['circuit']} since {c['since']}{ready}")
    return 0


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
    findings = asyncio.run(doctor.run(config, args.zone, probes=not args.no_probe, helo=helo))
    ok = all(f.status != "error" for f in findings)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [f.to_dict() for f in findings]}, indent=2))
    else:
        print(doctor.render_table(findings))
    return 0 if ok else 1


def cmd_sink(args: argparse.Namespace) -> int:
    from smtpguard import sink

    asyncio.run(sink.run(args.listen, Path(args.maildir)))
    return 0


# --- parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smtpguard", description="Idempotent SMTP submission proxy")
    p.add_argument("--version", action="version", version=f"smtpguard {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("-c", "--config", help=f"config file (default $SMTPGUARD_CONFIG or {DEFAULT_CONFIG})")
        sp.set_defaults(fn=fn)
        return sp

    cmd("serve", cmd_serve, "run the proxy")
    cmd("check-config", cmd_check_config, "validate the config")
    sub_hash = sub.add_parser("hash-password", help="read a password on stdin, print its hash")
    sub_hash.set_defaults(fn=cmd_hash_password)
    sp = cmd("history", cmd_history, "show an event's record and attempts")
    sp.add_argument("zone")
    sp.add_argument("key")
    sp.add_argument("--json", action="store_true")
    sp = cmd("resolve", cmd_resolve, "close an unknown outcome")
    sp.add_argument("zone")
    sp.add_argument("key")
    sp.add_argument("--as", dest="as_", required=True, choices=["delivered", "retry"])
    sp.add_argument(
        "--force",
        action="store_true",
        help="retry even while the owner that lost its lease may still be sending (risks a second copy)",
    )
    sp = cmd("release", cmd_release, "allow one new attempt of a failed event")
    sp.add_argument("zone")
    sp.add_argument("key")
    sp.add_argument(
        "--force",
        action="store_true",
        help="release even while an owner that lost its lease may still be sending (risks a second copy)",
    )
    for name, fn in (("pause", cmd_pause), ("resume", cmd_resume)):
        sp = cmd(name, fn, f"{name} a zone on every instance")
        sp.add_argument("zone")
    sp = cmd("suppress", cmd_suppress, "manage suppression lists")
    sp.add_argument("action", choices=["add", "remove", "list", "import", "export"])
    sp.add_argument("zone", help="a zone, or 'global'")
    sp.add_argument("address", nargs="?", help="address (add/remove) or CSV file (import)")
    sp.add_argument("--reason")
    sp.add_argument("--json", action="store_true")
    sp = cmd("queue", cmd_queue, "the store-and-forward queue")
    sp.add_argument("action", choices=["list", "retry", "drop"])
    sp.add_argument("zone", nargs="?")
    sp.add_argument("key", nargs="?")
    sp.add_argument("--json", action="store_true")
    sp = cmd("stats", cmd_stats, "sends, duplicates, rejections and cap use per zone")
    sp.add_argument("zone", nargs="?")
    sp.add_argument("--json", action="store_true")
    sp = cmd("doctor", cmd_doctor, "check DNS (SPF, DKIM, DMARC, MX) and probe every provider")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--zone", help="check this zone only")
    sp.add_argument("--no-probe", action="store_true", help="DNS checks only; no provider connection")
    sp = sub.add_parser("sink", help="a local test upstream writing to a Maildir")
    sp.add_argument("--listen", default="127.0.0.1:2525")
    sp.add_argument("--maildir", default="var/sink")
    sp.set_defaults(fn=cmd_sink)
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
        return 1
    except CLIError as e:
        print(f"smtpguard: {e}", file=sys.stderr)
        return 1
    except StoreUnavailable as e:
        print(f"smtpguard: store unavailable: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        print(f"smtpguard: {e.strerror or e}", file=sys.stderr)
        return 1
