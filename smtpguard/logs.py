"""Structured logs: one JSON object per line by default, `key=value` text with `log.format: text`.

Fields come from `extra=`; nothing here formats a message unless the level is enabled, and
nothing secret is ever passed in (AUTH payloads and passwords never reach a log call, nor do
message bodies). One name per thing in every line: `event_key`, `zone`, `client_ip`,
`session`, `sg_id`. A line logged with an exception carries its traceback (`traceback` in
JSON, the indented lines after the record in text): a bug must be findable from the log.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

_worker: int | None = None
"""This process's worker index under `workers: N`: every line says which worker wrote it."""

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    out: dict[str, object] = {
        "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    if _worker is not None:
        out["worker"] = _worker
    for k, v in record.__dict__.items():
        if k not in _STANDARD and not k.startswith("_"):
            out[k] = v
    if record.exc_info and record.exc_info[0] is not None:
        out["error_type"] = record.exc_info[0].__name__
        out["traceback"] = _formatter.formatException(record.exc_info)
    elif record.exc_text:
        out["traceback"] = record.exc_text
    if record.stack_info:
        out["stack"] = record.stack_info
    return out


_formatter = logging.Formatter()


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str, separators=(",", ":"))


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _unsafe(c: str) -> bool:
    return c in ' ="' or not c.isprintable()


def logfmt_value(value: object, space_ok: bool = False) -> str:
    """A value as logfmt writes it: bare when it is one plain word, else in double quotes
    with backslash escapes, so a client's Message-ID `<x@y> zone=globex` stays one field."""
    text = str(value)
    if text and not any(_unsafe(c) and not (space_ok and c == " ") for c in text):
        return text
    out = []
    for c in text:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif not c.isprintable() and c != " ":
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        f = _fields(record)
        msg = logfmt_value(f.pop("msg"), space_ok=True)
        head = f"{f.pop('time')} {str(f.pop('level')).upper():7} {msg}"
        f.pop("logger", None)
        trace = [str(f.pop(k)) for k in ("traceback", "stack") if k in f]
        line = head + "".join(f" {k}={logfmt_value(v)}" for k, v in f.items())
        for block in trace:
            line += "\n" + "\n".join("    " + t for t in block.splitlines())
        return line


def configure(fmt: str, level: str, worker: int | None = None) -> None:
    global _worker
    _worker = worker
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiosmtpd logs every command line at INFO, AUTH lines included; keep it quiet.
    logging.getLogger("mail.log").setLevel(logging.ERROR)
