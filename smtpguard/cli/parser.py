"""The argument parser: every command, its options and its help text."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from smtpguard import __version__
from smtpguard.cli.context import EXIT_CODES, JSON_SCHEMA
from smtpguard.cli.outbox import cmd_outbox
from smtpguard.cli.records import cmd_history, cmd_list, cmd_queue, cmd_release, cmd_resolve
from smtpguard.cli.service import (
    cmd_check_config,
    cmd_console,
    cmd_doctor,
    cmd_hash_password,
    cmd_healthcheck,
    cmd_migrate,
    cmd_serve,
    cmd_sink,
)
from smtpguard.cli.verdict import cmd_verdict
from smtpguard.cli.zones import cmd_pause, cmd_resume, cmd_stats, cmd_suppress
from smtpguard.config import DEFAULT_CONFIG
from smtpguard.policy import ledger


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
    sp = cmd(
        "verdict",
        cmd_verdict,
        "ask the provider's log about an unknown outcome now",
        "Ask the log API of the provider an `unknown` record's attempt went through "
        "(providers[].api, DESIGN.md §19) now, settle the record as the verdict loop would "
        "(accepted: delivered; refused: failed; not accepted: deferred) and print what the "
        "log said. Exit 0 on a verdict, 3 when there is none yet or no such record; a "
        "record that is not unknown is printed with its state and left alone (exit 0).",
    )
    sp.add_argument("zone")
    sp.add_argument("key")
    for name, fn in (("pause", cmd_pause), ("resume", cmd_resume)):
        sp = cmd(
            name,
            fn,
            f"{name} a zone on every instance",
            f"{name.capitalize()} a zone through the store, on every instance at once. Paused, "
            "new events get 451 4.7.0 and duplicates still get their 250. With --class, only "
            "that message class (the class header) of the zone, within a second; queue mode "
            "holds the class's entries instead. With --receiver, only the zone's recipients of "
            "that receiving provider (RCPT 451 4.7.1; queue mode holds them).",
        )
        sp.add_argument("zone")
        sp.add_argument(
            "--class", dest="message_class", metavar="CLASS", help=f"{name} one message class only"
        )
        sp.add_argument("--receiver", metavar="RECEIVER", help=f"{name} one receiving provider only")
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
        "Totals per zone since the store was created (sent, duplicates, rejections, held; "
        "sends and provider events per receiving provider) with live cap use, queue depth "
        "and each instance's provider circuits. Read-only.",
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
    cmd(
        "migrate",
        cmd_migrate,
        "bring the PostgreSQL store's schema up to this release",
        "Run this release's schema migrations now (DESIGN.md §18), ahead of a rolling "
        "upgrade: instances of the previous release keep serving meanwhile; large index "
        "builds run concurrently. Needs a role that may change the schema; `serve` runs the "
        "same at start. SQLite and Redis stores have nothing to run. Exit 0 when the schema "
        "is current, 4 when the store is unreachable or the role may not change it.",
    )
    sp = cmd(
        "outbox",
        cmd_outbox,
        "create or print the outbox table",
        "The outbox (DESIGN.md §20): init SOURCE creates the table and its NOTIFY trigger in "
        "the source's database (idempotent); schema [SOURCE] prints the DDL for a migration "
        "tool (--table names the table when no config is at hand).",
    )
    sp.add_argument("action", choices=["init", "schema"])
    sp.add_argument("source", nargs="?", help="a name under `outbox:` in the config")
    sp.add_argument("--table", help="schema only: the table name (default smtpguard_outbox)")
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
