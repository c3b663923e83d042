"""The X-Event-Key header: §3 rows "missing X-Event-Key" and "malformed key", §4 derive."""

from __future__ import annotations

import base64
import codecs
import encodings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smtpguard.policy.eventkey import (
    MAX_KEY_LENGTH,
    EventKey,
    MissingKeyMode,
    event_key,
    key_problem,
    message_id_for,
    qualified_key,
)
from smtpguard.policy.message import HeaderLimits, Message, parse
from smtpguard.replies import Reply

HEADER = "X-Event-Key"
FP = "ab" * 32


def msg(header_lines: bytes) -> Message:
    m = parse(b"From: a@acme.example\r\n" + header_lines + b"\r\nbody\r\n", HeaderLimits())
    assert isinstance(m, Message), m
    return m


@pytest.mark.parametrize(
    ("lines", "value"),
    [
        pytest.param(b"X-Event-Key: invoice:acme:1044\r\n", "invoice:acme:1044", id="plain"),
        pytest.param(b"x-event-key: order/77#a\r\n", "order/77#a", id="header-name-case"),
        pytest.param(b"X-Event-Key:    padded\r\n", "padded", id="outer-space-trimmed"),
        pytest.param(b"X-Event-Key:\r\n folded-whole\r\n", "folded-whole", id="folded-before-value"),
        pytest.param(b"X-Event-Key: " + b"k" * 200 + b"\r\n", "k" * 200, id="200-chars"),
        pytest.param("X-Event-Key: facture:société:7\r\n".encode(), "facture:société:7", id="utf8"),
    ],
)
@pytest.mark.parametrize("mode", ["reject", "derive", "allow"])
def test_valid_key_is_taken_as_is(lines: bytes, value: str, mode: MissingKeyMode) -> None:
    assert event_key(msg(lines), HEADER, mode, FP) == EventKey(value, derived=False)


MALFORMED = [
    pytest.param(b"X-Event-Key:\r\n", "empty", id="empty"),
    pytest.param(b"X-Event-Key:    \r\n", "empty", id="only-spaces"),
    pytest.param(b"X-Event-Key: " + b"k" * 201 + b"\r\n", "longer than 200", id="201-chars"),
    pytest.param(b"X-Event-Key: invoice 1044\r\n", "whitespace", id="inner-space"),
    pytest.param(b"X-Event-Key: invoice\t1044\r\n", "whitespace", id="inner-tab"),
    pytest.param(b"X-Event-Key: invoice:acme:\r\n 1044\r\n", "whitespace", id="folded-with-space"),
    pytest.param(b"X-Event-Key: invoice:acme:\r\n\t1044\r\n", "whitespace", id="folded-with-tab"),
    pytest.param(b"X-Event-Key: a\x01b\r\n", "control", id="control-char"),
    pytest.param(b"X-Event-Key: a\x7fb\r\n", "control", id="del"),
    pytest.param("X-Event-Key: a\u00a0b\r\n".encode(), "whitespace", id="nbsp"),
    pytest.param("X-Event-Key: a\u200bb\r\n".encode(), "control", id="zero-width-space"),
    pytest.param("X-Event-Key: a\u2028b\r\n".encode(), "whitespace", id="line-separator"),
    pytest.param(b"X-Event-Key: a\r\nX-Event-Key: a\r\n", "more than once", id="twice-same"),
    pytest.param(b"X-Event-Key: a\r\nx-event-key: b\r\n", "more than once", id="twice-any-case"),
    pytest.param(b"X-Event-Key: a\r\nX-Event-Key:\r\n", "more than once", id="twice-one-empty"),
]


@pytest.mark.parametrize(("lines", "reason"), MALFORMED)
@pytest.mark.parametrize("mode", ["reject", "derive", "allow"])
def test_malformed_key_is_550_560(lines: bytes, reason: str, mode: MissingKeyMode) -> None:
    result = event_key(msg(lines), HEADER, mode, FP)
    assert isinstance(result, Reply)
    assert (result.code, result.enhanced) == (550, "5.6.0")
    assert HEADER in result.text
    assert reason in result.text


def test_missing_key_with_reject_is_550_570_naming_the_header() -> None:
    result = event_key(msg(b"Subject: hi\r\n"), HEADER, "reject", FP)
    assert isinstance(result, Reply)
    assert (result.code, result.enhanced) == (550, "5.7.0")
    assert HEADER in result.text


def test_missing_key_names_the_configured_header() -> None:
    result = event_key(msg(b"X-Event-Key: k\r\n"), "X-Idempotency", "reject", FP)
    assert isinstance(result, Reply) and "X-Idempotency" in result.text


def test_missing_key_with_derive_is_auto_fingerprint() -> None:
    assert event_key(msg(b"Subject: hi\r\n"), HEADER, "derive", FP) == EventKey("auto:" + FP, derived=True)


def test_missing_key_with_allow_is_none() -> None:
    assert event_key(msg(b"Subject: hi\r\n"), HEADER, "allow", FP) is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        pytest.param("", "the key is empty", id="empty"),
        pytest.param("k" * (MAX_KEY_LENGTH + 1), "longer than 200", id="too-long"),
        pytest.param("a b", "whitespace", id="space"),
        pytest.param("a\r\nb", "whitespace", id="crlf"),
        pytest.param("a\x00b", "control", id="nul"),
        pytest.param("k" * MAX_KEY_LENGTH, None, id="max-length"),
        pytest.param("invoice:acme:1044", None, id="ordinary"),
    ],
)
def test_key_problem(value: str, problem: str | None) -> None:
    found = key_problem(value)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_message_id_is_deterministic_per_zone_and_key() -> None:
    a = message_id_for("acme", "invoice:1044", "guard.example")
    assert a == message_id_for("acme", "invoice:1044", "guard.example")
    assert a.startswith("<sg.") and a.endswith("@guard.example>")
    assert len(a) == len("<sg.@guard.example>") + 32


@pytest.mark.parametrize(
    ("other_zone", "other_key"),
    [
        pytest.param("globex", "invoice:1044", id="other-zone-same-key"),
        pytest.param("acme", "invoice:1045", id="same-zone-other-key"),
        pytest.param("acme:invoice", "1044", id="separator-is-not-ambiguous"),
    ],
)
def test_message_id_differs(other_zone: str, other_key: str) -> None:
    ours = message_id_for("acme", "invoice:1044", "guard.example")
    assert message_id_for(other_zone, other_key, "guard.example") != ours


def test_qualified_key_names_the_zone() -> None:
    assert qualified_key("acme", "invoice:1044") == "acme:invoice:1044"


HEADER_NAMES = st.sampled_from(["X-Event-Key", "x-event-key", "Subject", "From"])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(HEADER_NAMES, st.text(max_size=210)), max_size=4),
    st.sampled_from(["reject", "derive", "allow"]),
)
def test_event_key_never_raises(headers: list[tuple[str, str]], mode: MissingKeyMode) -> None:
    m = Message(tuple(headers), b"", b"")
    result = event_key(m, HEADER, mode, FP)
    values = [v for n, v in headers if n.lower() == HEADER.lower()]
    if len(values) > 1:
        assert isinstance(result, Reply) and (result.code, result.enhanced) == (550, "5.6.0")
    elif values:
        if key_problem(values[0]) is None:
            assert result == EventKey(values[0], derived=False)
        else:
            assert isinstance(result, Reply) and (result.code, result.enhanced) == (550, "5.6.0")
    elif mode == "reject":
        assert isinstance(result, Reply) and (result.code, result.enhanced) == (550, "5.7.0")
    elif mode == "derive":
        assert result == EventKey("auto:" + FP, derived=True)
    else:
        assert result is None
    if isinstance(result, Reply):
        assert not any(c in result.text for c in "\r\n")


# --- a key a mail library folded as RFC 2047 encoded-words -------------------------------------
FOLDED_BY_PYTHON = [
    pytest.param("invoice:acme:" + "x" * 120, id="long-ascii"),
    pytest.param("order-" + "y" * 70 + "-" + "z" * 70, id="long-ascii-two-parts"),
    pytest.param("facture:société:" + "é" * 60 + "ü" * 30, id="long-utf8-base64"),
    pytest.param("k_" * 60, id="underscores"),
]


def _as_python_writes(key: str) -> bytes:
    """The header block Python's email package writes for this key (policy default)."""
    from email.message import EmailMessage

    m = EmailMessage()
    m["X-Event-Key"] = key
    return m.as_bytes().replace(b"\n", b"\r\n")


@pytest.mark.parametrize("key", FOLDED_BY_PYTHON)
def test_a_key_folded_as_encoded_words_is_the_key_the_application_wrote(key: str) -> None:
    block = _as_python_writes(key)
    assert b"=?utf-8?" in block and b"\r\n " in block  # folded, as the library writes it
    assert event_key(msg(block), HEADER, "reject", FP) == EventKey(key, derived=False)


@pytest.mark.parametrize(
    ("lines", "value"),
    [
        # One encoded-word alone was always the literal key: a retry across an upgrade
        # must find the same record.
        pytest.param(b"X-Event-Key: =?utf-8?q?inv=3A1?=\r\n", "=?utf-8?q?inv=3A1?=", id="one-word-literal"),
        pytest.param(
            b"X-Event-Key: =?UTF-8?Q?inv=3A?=\r\n =?utf-8?B?MTA0NA==?=\r\n", "inv:1044", id="mixed-q-b-case"
        ),
        pytest.param(
            b"X-Event-Key: =?utf-8*en?q?inv=3A?=\r\n =?utf-8?q?7?=\r\n", "inv:7", id="rfc2231-language"
        ),
        pytest.param(
            b"X-Event-Key: =?ISO-8859-1?Q?r=E9f=3A?=\r\n =?iso-8859-1?q?7?=\r\n", "réf:7", id="latin1"
        ),
        pytest.param(
            # A character split over two words of one charset (é is C3 A9).
            b"X-Event-Key: =?utf-8?q?caf=C3?=\r\n =?utf-8?q?=A9?=\r\n",
            "café",
            id="split-character",
        ),
    ],
)
def test_encoded_words_decode_only_when_folded(lines: bytes, value: str) -> None:
    assert event_key(msg(lines), HEADER, "reject", FP) == EventKey(value, derived=False)


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        pytest.param(
            b"X-Event-Key: =?utf-8?q?a_b?=\r\n =?utf-8?q?c?=\r\n", "whitespace", id="decodes-to-space"
        ),
        pytest.param(
            b"X-Event-Key: =?utf-8?q?a=0Ab?=\r\n =?utf-8?q?c?=\r\n", "whitespace", id="decodes-to-lf"
        ),
        pytest.param(b"X-Event-Key: =?utf-8?q?a=01?=\r\n =?utf-8?q?c?=\r\n", "control", id="decodes-to-ctl"),
        pytest.param(b"X-Event-Key: =?no-such?q?a?=\r\n =?utf-8?q?c?=\r\n", "decoded", id="unknown-charset"),
        pytest.param(b"X-Event-Key: =?utf-8?b?!!?=\r\n =?utf-8?q?c?=\r\n", "decoded", id="bad-base64"),
        # Python codecs that are no charset a mail library writes: never a crash, never a key.
        pytest.param(b"X-Event-Key: =?rot13?q?a?=\r\n =?rot13?q?c?=\r\n", "decoded", id="not-a-text-codec"),
        pytest.param(b"X-Event-Key: =?zlib?q?a?=\r\n =?zlib?q?c?=\r\n", "decoded", id="binary-codec"),
        pytest.param(
            b"X-Event-Key: =?unicode_escape?q?a?=\r\n =?unicode_escape?q?c?=\r\n",
            "decoded",
            id="python-codec",
        ),
        pytest.param(b"X-Event-Key: =?utf-8?q?=FF?=\r\n =?utf-8?q?c?=\r\n", "decoded", id="not-utf8"),
        pytest.param(
            b"X-Event-Key: =?utf-8?q?" + b"k" * 150 + b"?=\r\n =?utf-8?q?" + b"k" * 51 + b"?=\r\n",
            "longer than 200",
            id="decodes-too-long",
        ),
        pytest.param(
            b"X-Event-Key: x =?utf-8?q?a?=\r\n =?utf-8?q?c?=\r\n", "whitespace", id="text-beside-words"
        ),
    ],
)
def test_folded_encoded_words_that_make_no_key_are_550_560(lines: bytes, reason: str) -> None:
    result = event_key(msg(lines), HEADER, "reject", FP)
    assert isinstance(result, Reply), result
    assert (result.code, result.enhanced) == (550, "5.6.0") and reason in result.text, result


def test_charset_names_a_client_makes_up_are_not_kept_by_the_codec_registry() -> None:
    # Python's codec search caches every name it fails to find, for the life of the process
    # (encodings._cache). Looked up as written, each message naming a charset of its own
    # (`=?x1a2…?q?a?=`) left its name there: memory an authenticated client could grow
    # without bound, one refused message at a time.
    before = len(encodings._cache)  # type: ignore[attr-defined]
    for n in range(200):
        name = f"made-up-{n}-" + "x" * 500
        lines = f"X-Event-Key: =?{name}?q?a?=\r\n =?{name}?q?c?=\r\n".encode()
        result = event_key(msg(lines), HEADER, "reject", FP)
        assert isinstance(result, Reply) and "decoded" in result.text, result
    assert len(encodings._cache) - before < 10  # type: ignore[attr-defined]


SPELLINGS = ["utf-8", "UTF-8", "utf8", "u8", "cp65001", "us-ascii", "ASCII", "latin1", "ISO-8859-1"]
SPELLINGS += ["iso_8859-15", "l1", "windows-1252", "CP1251", "koi8-r", "KOI8-U", "Shift_JIS", "sjis"]
SPELLINGS += ["euc-jp", "ISO-2022-JP", "euc-kr", "ks_c_5601-1987", "gb2312", "GBK", "cp936", "GB18030"]
SPELLINGS += ["big5", "utf-8*en"]


@pytest.mark.parametrize("charset", SPELLINGS)
def test_every_spelling_of_a_mail_charset_still_decodes(charset: str) -> None:
    codec = codecs.lookup(charset.partition("*")[0]).name

    def word(text: str) -> bytes:
        return f"=?{charset}?b?{base64.b64encode(text.encode(codec)).decode()}?=".encode()

    found = event_key(
        msg(b"X-Event-Key: " + word("order:") + b"\r\n " + word("42") + b"\r\n"), HEADER, "reject", FP
    )
    assert isinstance(found, EventKey) and found.value == "order:42", found


@pytest.mark.parametrize("charset", ["big5-hkscs", "utf-16", "cp037", "-", "utf-8\u00e9", "."])
def test_a_charset_outside_the_mail_ones_is_no_key_whatever_its_spelling(charset: str) -> None:
    lines = f"X-Event-Key: =?{charset}?q?a?=\r\n =?{charset}?q?c?=\r\n".encode()
    found = event_key(msg(lines), HEADER, "reject", FP)
    assert isinstance(found, Reply) and "decoded" in found.text, found
