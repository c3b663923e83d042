"""Admission (DESIGN.md §3): a message passes smuggling → parse → From → fingerprint → key →
Message-ID → class → caps, in that order, before the ledger is asked.

Through the real listener and a recording upstream: each case's message fails its own step
and every later one, so the reply shows which step comes first; nothing reaches the upstream
and no cap unit is used. Fingerprint cannot fail; Message-ID is seen on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from smtpguard.policy.admission import Admitted, Refused, Rules, admit
from smtpguard.policy.eventkey import MissingKeyMode, message_id_for
from smtpguard.policy.limits import Caps, month_of
from smtpguard.policy.message import HeaderLimits
from smtpguard.server import Server
from tests.queue.test_queue import queue_config
from tests.support import Upstream, base_config, message, running_guard, send


def _raw(step: str) -> bytes:
    """A message failing `step` and every step after it: From not mapped, no key, a class no
    zone has; and before From, a header block too big, before that a NUL in the body."""
    msg = message(None, sender="someone@elsewhere.example", headers={"X-Message-Class": "no-such-class"})
    if step in ("parse", "smuggling"):
        msg["X-Padding"] = "x" * (64 * 1024)
    raw = msg.as_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    if step == "smuggling":
        raw = raw.replace(b"Your invoice.", b"Your\x00invoice.")
    if step in ("key", "class", "caps"):
        raw = raw.replace(b"From: someone@elsewhere.example", b"From: billing@acme.example")
    if step in ("class", "caps"):
        raw = raw.replace(b"Subject:", b"X-Event-Key: adm:1\r\nSubject:")
    if step == "caps":
        raw = raw.replace(b"no-such-class", b"bulk")
    return raw


STEPS: dict[str, tuple[int, str]] = {
    # step: (code, a phrase of its reply)
    "smuggling": (550, "Bare CR, bare LF or NUL"),
    "parse": (550, "header block exceeds 65536 bytes"),
    "from": (550, "is not a mapped alias of zone acme"),
    "key": (550, "Missing X-Event-Key header"),
    "class": (550, "X-Message-Class must be one of bulk, otp, transactional"),
    "caps": (451, "Hourly cap of 0 reached for zone acme"),
}


def _config(tmp: Path, port: int, queue: bool) -> dict[str, Any]:
    if queue:
        return queue_config(tmp, port)
    return base_config(tmp, port, zones__acme__hourly_cap=0)


async def _units(guard: Server) -> tuple[int, int]:
    assert guard.store is not None
    now = guard.clock()
    usage = await guard.store.cap_usage("acme", now, month_of(now))
    return usage.hour, usage.month


@pytest.mark.parametrize(
    ("step", "queue"),
    [
        *((s, True) for s in ("smuggling", "parse", "from", "key", "class")),
        # Relay mode validates no class; its caps are counted at submission.
        *((s, False) for s in ("smuggling", "parse", "from", "key", "caps")),
    ],
)
async def test_each_step_refuses_before_every_later_one(
    step: str, queue: bool, tmp: Path, upstream: Upstream
) -> None:
    code, phrase = STEPS[step]
    async with running_guard(_config(tmp, upstream.port, queue)) as guard:
        reply = await send(guard.ports[0], _raw(step))
        units = await _units(guard)
    print(f"admission, {step} ({'queue' if queue else 'relay'}): {reply}")
    assert reply.code == code and phrase in reply.text, str(reply)
    assert upstream.received == [] and units == (0, 0)


async def test_a_message_without_message_id_leaves_with_the_one_smtpguard_makes(
    tmp: Path, upstream: Upstream
) -> None:
    async with running_guard(base_config(tmp, upstream.port)) as guard:
        made = await send(guard.ports[0], message("adm:made"))
        given = await send(guard.ports[0], message("adm:given", headers={"Message-ID": "<own@acme.example>"}))
    assert made.code == 250 and given.code == 250
    ids = {r.header("X-Event-Key"): r.header("Message-ID") for r in upstream.received}
    assert ids["adm:given"] == "<own@acme.example>"
    made_id = ids["adm:made"]
    assert made_id is not None and made_id.startswith("<") and made_id.endswith("@guard.test>"), made_id
    assert len(upstream.received) == 2


# --- the pure call (policy/admission.py) -------------------------------------------------------
@dataclass(frozen=True)
class _User:
    username: str
    hourly_cap: int | None = None
    monthly_cap: int | None = None


@dataclass(frozen=True)
class _Zone:
    senders: tuple[str, ...] = ("billing@acme.example",)
    missing_key: MissingKeyMode = "reject"
    delivery: str = "queue"
    default_class: str | None = None
    plan: str = "business"
    hourly_cap: int | None = 0
    monthly_cap: int | None = None
    users: tuple[_User, ...] = (_User("acme-app", hourly_cap=5),)


RULES = Rules(
    HeaderLimits(),
    ("X-Event-Key",),
    "X-Message-Class",
    "transactional",
    {"otp": 600.0, "transactional": 259200.0, "bulk": 86400.0},
    "guard.test",
)
ATTEMPT = "018f00000000aaaaaaaa"


def _admit(raw: bytes, zone: _Zone = _Zone()) -> Admitted | Refused:
    return admit(
        raw, "billing@acme.example", ["customer@example.com"], "acme", "acme-app", zone, RULES, ATTEMPT
    )


@pytest.mark.parametrize(
    ("step", "decision"),
    [
        ("smuggling", "rejected:bare_newline"),
        ("parse", "rejected:malformed"),
        ("from", "rejected:from"),
        ("key", "rejected:key"),
        ("class", "rejected:class"),
    ],
)
def test_each_step_refuses_first_and_names_its_decision(step: str, decision: str) -> None:
    got = _admit(_raw(step))
    code, phrase = STEPS[step]
    assert isinstance(got, Refused) and got.decision == decision
    assert got.reply.code == code and phrase in got.reply.text, got.reply
    # Only a refusal after the key step carries the attempt's key and Message-ID.
    assert (got.key, got.message_id is not None) == (("adm:1", True) if step == "class" else (None, False))


def test_an_admitted_message_carries_its_key_ids_class_and_caps() -> None:
    got = _admit(_raw("caps"))
    assert isinstance(got, Admitted)
    assert (got.key, got.derived, got.lane, got.max_age) == ("adm:1", False, "bulk", 86400.0)
    assert got.message_id == message_id_for("acme", "adm:1", "guard.test")
    assert got.added_header == f"Message-ID: {got.message_id}\r\n".encode()
    # Admission names the caps; relay mode's reservation counts them.
    assert got.caps == Caps(hourly=0, monthly=12_000) and got.user_caps == Caps(hourly=5, monthly=12_000)


def test_relay_mode_validates_no_class_and_a_missing_key_may_be_allowed() -> None:
    relay = _Zone(delivery="relay", missing_key="allow")
    got = _admit(
        _raw("key").replace(b"From: someone@elsewhere.example", b"From: billing@acme.example"), relay
    )
    assert isinstance(got, Admitted)
    assert (got.key, got.lane, got.max_age) == (f"msg:{ATTEMPT}", None, None)
