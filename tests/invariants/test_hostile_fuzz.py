"""Fuzzing: a bounded run of tests/support/fuzz_data.py, hypothesis-driven DATA over a real socket,
and no-exception properties of the address and From parsing and of the fingerprint.

(Header parsing, the smuggling check and key validation have their properties in
tests/policy/test_message.py and tests/policy/test_eventkey.py.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smtpguard.policy.fingerprint import fingerprint
from smtpguard.policy.message import HeaderLimits, Message, parse
from smtpguard.policy.senders import (
    address_problem,
    check_header_from,
    header_from_address,
    normalize_address,
    sender_allowed,
)
from smtpguard.replies import Reply
from tests.support.fuzz_data import Stats, run, target

ALIASES = ["billing@acme.example", "@notify.acme.example"]


async def test_fuzz_run_of_six_seconds_finds_no_crash(tmp: Path) -> None:
    stats = await run(seconds=6, seed=20261129, workdir=tmp)
    assert stats.crashes == 0 and not stats.violations, stats.summary()
    assert stats.inputs > 100, stats.summary()
    assert stats.relayed > 0 and stats.duplicates > 0, stats.summary()
    assert {"250", "550", "552"} <= set(stats.replies), stats.summary()


# --- hypothesis over the socket -------------------------------------------------------------------
TRICKY_FROM = st.sampled_from(
    [
        b"billing@acme.example",
        b"Acme <billing@acme.example>",
        b"=?utf-8?b?YmlsbGluZ0BhY21lLmV4YW1wbGU=?= <evil@attacker.example>",
        b"billing@acme.example <evil@attacker.example>",
        b'"billing@acme.example" <evil@attacker.example>',
        b"billing@acme.example, evil@attacker.example",
        b"evil@attacker.example (billing@acme.example)",
        b"<billing@acme.example>\r\n\t<evil@attacker.example>",
    ]
)
HEADER = st.one_of(
    st.builds(lambda v: b"From: " + v, st.one_of(TRICKY_FROM, st.binary(max_size=60))),
    st.builds(lambda v: b"X-Event-Key: " + v, st.binary(min_size=0, max_size=40)),
    st.builds(
        lambda n, v: n + b": " + v,
        st.sampled_from(
            [b"To", b"Subject", b"x-event-key", b"FROM", b"Content-Type", b" folded", b"\tfolded"]
        ),
        st.binary(max_size=60),
    ),
)
MESSAGES = st.one_of(
    st.binary(max_size=1500),
    st.builds(
        lambda lines, sep, body: sep.join(lines) + sep + sep + body,
        st.lists(HEADER, max_size=8),
        st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r"]),
        st.binary(max_size=400),
    ),
    st.builds(
        lambda key, sender, body: b"From: " + sender + b"\r\nX-Event-Key: h:" + key + b"\r\n\r\n" + body,
        st.text("abcdef0123456789", min_size=1, max_size=12).map(str.encode),
        TRICKY_FROM,
        st.binary(max_size=300),
    ),
)


def test_hypothesis_data_over_the_socket(tmp_path: Path) -> None:
    """Every generated message gets an answer, and only a 250 puts anything at the upstream."""
    stats = Stats()
    loop = asyncio.new_event_loop()
    running = target(tmp_path, stats)
    t = loop.run_until_complete(running.__aenter__())
    try:

        @settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
        @given(MESSAGES)
        def one(message: bytes) -> None:
            reply = loop.run_until_complete(t.transact(message))
            assert reply.code in (250, 421, 500, 501, 550, 552), reply
            assert not stats.violations, stats.violations

        one()
    finally:
        loop.run_until_complete(running.__aexit__(None, None, None))
        loop.close()
    assert stats.crashes == 0, stats.violations
    assert stats.inputs >= 80


# --- properties of the pure parsers -------------------------------------------------------------
ANY_TEXT = st.one_of(
    st.text(),
    st.binary().map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.text(alphabet='abc@.<>()",:;!%[] \t\r\n\x00\\=?', max_size=60),
)


@given(ANY_TEXT)
def test_address_functions_never_raise(text: str) -> None:
    problem = address_problem(text)
    assert problem is None or isinstance(problem, str)
    normal = normalize_address(text)
    assert normalize_address(normal) == normal
    if sender_allowed(text, ALIASES):
        assert normal.lower().rpartition("@")[2] in {"acme.example", "notify.acme.example"}


@given(ANY_TEXT)
def test_header_from_never_raises_and_names_an_address_that_was_written(value: str) -> None:
    address = header_from_address(value)
    if address is not None:
        assert address_problem(address) is None
        assert address in value
    refused = check_header_from([value], "acme", ALIASES)
    reply = refused.reply if refused else None
    assert reply is None or (isinstance(reply, Reply) and reply.code == 550)
    if reply is None:
        assert address is not None and sender_allowed(address, ALIASES)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(ANY_TEXT, st.lists(ANY_TEXT, max_size=4), st.binary(max_size=2000))
def test_fingerprint_never_raises(mail_from: str, rcpts: list[str], data: bytes) -> None:
    parsed = parse(data, HeaderLimits())
    message = parsed if isinstance(parsed, Message) else Message((), b"", data)
    digest = fingerprint(mail_from, rcpts, message)
    assert len(digest) == 64 and digest == fingerprint(mail_from, list(reversed(rcpts)), message)
