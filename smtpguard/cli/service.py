"""Commands that run or check the service: serve, check-config, healthcheck, hash-password,
console, migrate, doctor, sink."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import socket
import sys
from pathlib import Path
from typing import Any

from smtpguard.cli.context import EXIT_FAILED, EXIT_OK, CLIError, _config, _config_path, emit
from smtpguard.config import ConfigError, read_secret
from smtpguard.store import StoreUnavailable, store_from_url


def cmd_serve(args: argparse.Namespace) -> int:
    from smtpguard import logs
    from smtpguard.config import worker_count
    from smtpguard.server import process
    from smtpguard.workers import WorkerRole

    config = _config(args)
    role = WorkerRole.from_env()
    logs.configure(config.log.format, config.log.level, worker=role.index if role else None)
    if role is None and worker_count(config.workers) > 1:
        from smtpguard.supervisor import supervise

        return supervise(config, Path(_config_path(args)))
    process.serve(config, Path(_config_path(args)), role)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from smtpguard.config import outbox_secrets, provider_secrets, worker_count
    from smtpguard.verp import verp_key

    try:
        config = _config(args)
        provider_secrets(config)
        outbox_secrets(config)  # serve reads them at start too
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


def cmd_console(args: argparse.Namespace) -> int:
    from smtpguard import logs
    from smtpguard.console import standalone

    config = _config(args)
    if config.console is None:
        raise CLIError("the config has no console: section")
    logs.configure(config.log.format, config.log.level)
    asyncio.run(standalone.run(config, _config_path(args)))
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    config = _config(args)
    if not config.store.url.startswith(("postgresql://", "postgres://")):
        doc: dict[str, Any] = {"store": config.store.url.split("://")[0], "migrated": False}
        if args.json:
            emit(doc)
        else:
            print("smtpguard: nothing to migrate: only a PostgreSQL store has migrations to run ahead")
        return EXIT_OK
    from smtpguard.store.postgres.upgrade import run_migrations

    password = read_secret(config.store.password_env, config.store.password_file, "store")
    done = asyncio.run(run_migrations(config.store.url, password))
    doc = {
        "store": "postgresql",
        "migrated": done.after > done.before,
        "from": done.before,
        "to": done.after,
        "concurrently": list(done.concurrent),
        "seconds": round(done.seconds, 3),
    }
    if args.json:
        emit(doc)
    elif done.after > done.before:
        built = f"; built concurrently: {', '.join(done.concurrent)}" if done.concurrent else ""
        print(f"schema version {done.before} → {done.after} in {done.seconds:.1f} s{built}")
    else:
        print(f"schema version {done.after}: current, nothing to do")
    return EXIT_OK


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
