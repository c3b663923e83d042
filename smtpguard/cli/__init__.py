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

import os
import sys
from collections.abc import Sequence

from smtpguard.cli.context import (
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_STORE,
    EXIT_USAGE,
    JSON_SCHEMA,
    CLIError,
    NotFound,
    UsageError,
    actor,
    emit,
    iso,
)
from smtpguard.cli.parser import build_parser
from smtpguard.cli.records import history_json, list_records
from smtpguard.config import ConfigError
from smtpguard.store import StoreMissing, StoreUnavailable, StoreUnfit

__all__ = [
    "EXIT_CODES",
    "EXIT_FAILED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_STORE",
    "EXIT_USAGE",
    "JSON_SCHEMA",
    "CLIError",
    "NotFound",
    "UsageError",
    "actor",
    "build_parser",
    "emit",
    "history_json",
    "iso",
    "list_records",
    "main",
]


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
    except (StoreMissing, StoreUnfit) as e:
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
