"""Structured logs: one JSON object per line by default, `key=value` text with `log.format: text`.

Fields come from `extra=`; nothing here formats a message unless the level is enabled, and
nothing secret is ever passed in (AUTH payloads and passwords never reach a log call).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    out: dict[str, object] = {
        "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for k, v in record.__dict__.items():
        if k not in _STANDARD and not k.startswith("_"):
            out[k] = v
    if record.exc_info and record.levelno >= logging.ERROR:
        out["error_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
    return out


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        f = _fields(record)
        head = f"{f.pop('time')} {str(f.pop('level')).upper():7} {f.pop('msg')}"
        f.pop("logger", None)
        return head + "".join(f" {k}={v}" for k, v in f.items())


def configure(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiosmtpd logs every command line at INFO, AUTH lines included; keep it quiet.
    logging.getLogger("mail.log").setLevel(logging.ERROR)
