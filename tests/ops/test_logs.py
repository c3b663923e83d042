"""Logs that explain: a traceback when something broke, one decision line per submission
that places it (smtpguard id, Message-ID, client IP, session), one name per field, and
never a password or a message body."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest

from smtpguard.logs import JSONFormatter, TextFormatter
from tests.support import (
    PASSWORD,
    GuardProcess,
    Upstream,
    base_config,
    free_port,
    message,
    send,
    write_config,
)

ROOT = Path(__file__).resolve().parents[2]


def log_with(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"smtpguard.test.{type(formatter).__name__}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out


def fail() -> None:
    raise ZeroDivisionError("the bug")


@pytest.mark.parametrize("formatter", [JSONFormatter(), TextFormatter()], ids=["json", "text"])
def test_log_exception_keeps_the_traceback(formatter: logging.Formatter) -> None:
    logger, out = log_with(formatter)
    try:
        fail()
    except ZeroDivisionError:
        logger.exception("internal error while handling a submission", extra={"zone": "acme"})
    text = out.getvalue()
    if isinstance(formatter, JSONFormatter):
        (line,) = text.splitlines()
        doc = json.loads(line)
        assert doc["error_type"] == "ZeroDivisionError" and doc["zone"] == "acme"
        trace = doc["traceback"]
    else:
        head, *rest = text.splitlines()
        assert "internal error while handling a submission" in head and "zone=acme" in head
        assert rest and all(line.startswith("    ") for line in rest)
        trace = "\n".join(rest)
    assert "Traceback (most recent call last)" in trace
    assert "in fail" in trace and "ZeroDivisionError: the bug" in trace


@pytest.mark.parametrize("formatter", [JSONFormatter(), TextFormatter()], ids=["json", "text"])
def test_exc_info_at_warning_is_kept_too(formatter: logging.Formatter) -> None:
    logger, out = log_with(formatter)
    try:
        fail()
    except ZeroDivisionError as e:
        logger.warning("renewal failed", exc_info=e)
    assert "ZeroDivisionError: the bug" in out.getvalue()


async def test_the_decision_line_places_the_submission(tmp: Path, upstream: Upstream) -> None:
    cfg = base_config(tmp, upstream.port)
    port = free_port()
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    log_path = tmp / "guard.log"
    proc = GuardProcess(write_config(tmp / "smtpguard.yaml", cfg), log_path)
    body = "BODY-MARKER-7f3a never to be logged\n"
    proc.start()
    try:
        await proc.wait_port(port)
        first = await send(port, message("dl:1", body=body, headers={"Message-ID": "<m1@acme.example>"}))
        again = await send(port, message("dl:1", body=body, headers={"Message-ID": "<m1@acme.example>"}))
        wrong = await send(port, message("dl:2"), password="not-" + PASSWORD)
    finally:
        assert await proc.astop() == 0
    assert first.code == 250 and again.code == 250 and wrong.code == 535
    text = log_path.read_text()
    assert PASSWORD not in text and "BODY-MARKER" not in text
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    decisions = [d for d in lines if d["logger"] == "smtpguard.decision" and d["msg"] == "decision"]
    assert [d["decision"] for d in decisions] == ["relayed", "duplicate"]
    sg_first = re.search(r"\[sg:([0-9a-f]+)\]", first.text)
    assert sg_first is not None
    for d in decisions:
        assert d["zone"] == "acme" and d["event_key"] == "dl:1" and "key" not in d
        assert d["client_ip"] == "127.0.0.1"
        assert d["message_id"] == "<m1@acme.example>"
        assert re.fullmatch(r"[0-9a-f]{12}", d["session"])
        # The duplicate names the event's history id: what `history` and the reply show.
        assert d["sg_id"] == sg_first.group(1)
    assert decisions[0]["session"] != decisions[1]["session"], "one session id per connection"
    failed = [d for d in lines if d["msg"] == "authentication failed"]
    assert failed and failed[0]["client_ip"] == "127.0.0.1" and failed[0]["session"]


def test_event_key_is_the_one_name_for_the_key_in_every_log_line() -> None:
    """Checked by search: no log call's extra= names the event key `key`."""
    offenders = []
    for path in sorted((ROOT / "smtpguard").rglob("*.py")):
        source = path.read_text()
        for m in re.finditer(r"extra=\{[^{}]*\}", source):
            if re.search(r"""["']key["']\s*:""", m.group(0)):
                line = source.count("\n", 0, m.start()) + 1
                offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, offenders


_QUOTED = r'"(?:[^"\\]|\\.)*"'
_HEAD = re.compile(rf"\S+ \S+ +(?:{_QUOTED}|\S+)")
_PAIR = re.compile(rf' ([a-z_]+)=({_QUOTED}|[^ "]*)')


def logfmt_fields(line: str) -> list[tuple[str, str]]:
    """The fields of one text line, read strictly left to right after the time, level and
    message, as a logfmt reader would."""
    head = _HEAD.match(line)
    assert head is not None, line
    out, at = [], head.end()
    while at < len(line):
        m = _PAIR.match(line, at)
        assert m is not None, f"not logfmt at {at}: {line}"
        k, v = m.groups()
        out.append((k, json.loads(v.replace("\\x", "\\u00")) if v.startswith('"') else v))
        at = m.end()
    return out


async def test_text_logs_quote_values_so_a_client_cannot_forge_fields(tmp: Path, upstream: Upstream) -> None:
    port = free_port()
    cfg = base_config(tmp, upstream.port, log={"format": "text", "level": "info"})
    cfg["listen"] = [{"address": f"127.0.0.1:{port}", "tls": "none"}]
    log_path = tmp / "guard.log"
    proc = GuardProcess(write_config(tmp / "smtpguard.yaml", cfg), log_path)
    forged = '<x@y> zone=globex decision=duplicate "q" \\'
    raw = (
        message("forge:1")
        .as_bytes()
        .replace(b"X-Event-Key:", f"Message-ID: {forged}\r\nX-Event-Key:".encode())
    )
    proc.start()
    try:
        await proc.wait_port(port)
        assert (await send(port, raw)).code == 250
    finally:
        assert await proc.astop() == 0
    (line,) = [x for x in log_path.read_text().splitlines() if " decision " in x and "forge:1" in x]
    fields = logfmt_fields(line)
    assert [v for k, v in fields if k == "zone"] == ["acme"], line
    assert [v for k, v in fields if k == "decision"] == ["relayed"], line
    assert dict(fields)["message_id"] == forged


def test_text_logs_escape_control_characters() -> None:
    logger, out = log_with(TextFormatter())
    logger.info("a message with zone=x in it", extra={"event_key": "k\nlevel=error\x00\u2028", "empty": ""})
    (line,) = out.getvalue().splitlines()
    fields = dict(logfmt_fields(line))
    assert fields == {"event_key": "k\nlevel=error\x00\u2028", "empty": ""}, line
    assert '"a message with zone=x in it"' in line
