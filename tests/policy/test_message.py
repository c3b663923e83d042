"""DATA checks: SMTP smuggling (§3 bare LF/CR/NUL row) and the header block parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smtpguard import replies
from smtpguard.policy.message import HeaderLimits, Message, parse, smuggling_check
from smtpguard.replies import Reply

CLEAN = (
    b"From: Billing <billing@acme.example>\r\n"
    b"To: ann@example.org\r\n"
    b"Subject: Invoice 1044\r\n"
    b"X-Event-Key: invoice:acme:1044\r\n"
    b"\r\n"
    b"Hello Ann,\r\n"
    b"\r\n"
    b"..a dot-stuffed line and a lone . in text\r\n"
    b"Regards\r\n"
)
LIMITS = HeaderLimits()


# --- smuggling_check ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data",
    [
        pytest.param(CLEAN, id="headers-and-body"),
        pytest.param(b"", id="empty"),
        pytest.param(b"Subject: x\r\n", id="single-header"),
        pytest.param(b"Subject: x\r\n\r\n\r\n\r\n", id="blank-lines"),
        pytest.param(b"Subject: x\r\n\r\n.\xc3\xa9\xff binary-ish but no CR/LF/NUL\r\n", id="8bit"),
    ],
)
def test_clean_crlf_passes(data: bytes) -> None:
    assert smuggling_check(data) is None


BARE = [
    pytest.param(b"Subject: x\nTo: y\r\n\r\nbody\r\n", id="bare-lf-in-headers"),
    pytest.param(b"Subject: x\r\n\r\nline one\nline two\r\n", id="bare-lf-in-body"),
    pytest.param(b"Subject: x\r\n\r\nline one\rline two\r\n", id="bare-cr-in-body"),
    pytest.param(b"Subject: x\r\n\r\nbody\r\n\n", id="trailing-bare-lf"),
    pytest.param(b"Subject: x\r\n\r\nbody\r", id="trailing-bare-cr"),
    pytest.param(b"\rSubject: x\r\n", id="leading-bare-cr"),
    pytest.param(b"Subject: x\r\r\n", id="cr-cr-lf"),
    pytest.param(b"Subject: x\r\n\n", id="cr-lf-lf"),
    pytest.param(b"Subject: x\x00\r\n", id="nul-in-header"),
    pytest.param(b"Subject: x\r\n\r\nbo\x00dy\r\n", id="nul-in-body"),
    pytest.param(b"\x00", id="nul-alone"),
]


@pytest.mark.parametrize("data", BARE)
def test_bare_cr_lf_nul_is_550_552(data: bytes) -> None:
    reply = smuggling_check(data)
    assert reply == replies.BARE_NEWLINE
    assert reply is not None and (reply.code, reply.enhanced) == (550, "5.5.2")


# End-of-data look-alikes that other MTAs accept as the end of the message: whatever follows
# would be a second, smuggled message (CVE-2023-51766 and friends).
SMUGGLING_ENDINGS = [
    b"\n.\r\n",
    b"\r\n.\n",
    b"\n.\n",
    b"\r.\r",
    b"\r.\n",
    b"\n.\r",
    b"\r.\r\n",
    b"\r\n.\r",
    b"\r\n\x00.\r\n",
    b"\r\n.\x00\r\n",
]
SMUGGLED = b"MAIL FROM:<ceo@victim.example>\r\nRCPT TO:<x@example.org>\r\nDATA\r\nSubject: pay\r\n"


@pytest.mark.parametrize("ending", SMUGGLING_ENDINGS, ids=repr)
def test_end_of_data_smuggling_variants_are_caught(ending: bytes) -> None:
    data = CLEAN + b"text before" + ending + SMUGGLED
    reply = smuggling_check(data)
    assert reply is not None
    assert (reply.code, reply.enhanced) == (550, "5.5.2")


# --- parse -------------------------------------------------------------------------------------
def parsed(data: bytes, limits: HeaderLimits = LIMITS) -> Message:
    result = parse(data, limits)
    assert isinstance(result, Message), result
    return result


def test_parse_splits_headers_and_body() -> None:
    m = parsed(CLEAN)
    assert m.headers == (
        ("From", "Billing <billing@acme.example>"),
        ("To", "ann@example.org"),
        ("Subject", "Invoice 1044"),
        ("X-Event-Key", "invoice:acme:1044"),
    )
    assert m.header_block == CLEAN[: CLEAN.index(b"\r\n\r\n") + 2]
    assert m.body == b"Hello Ann,\r\n\r\n..a dot-stuffed line and a lone . in text\r\nRegards\r\n"


@pytest.mark.parametrize(
    ("data", "name", "value"),
    [
        pytest.param(b"Subject: a\r\n b\r\n\r\n", "Subject", "a b", id="space-continuation"),
        pytest.param(b"Subject: a\r\n\tb\r\n\r\n", "Subject", "a\tb", id="tab-continuation"),
        pytest.param(
            b"Subject:\r\n  first\r\n  second\r\n third\r\n\r\nx",
            "Subject",
            "first  second third",
            id="several-continuations",
        ),
        pytest.param(b"Subject:   padded   \r\n\r\n", "Subject", "padded", id="outer-space-trimmed"),
        pytest.param(b"Subject:\r\n\r\n", "Subject", "", id="empty-value"),
        pytest.param(b"Subject:no-space\r\n\r\n", "Subject", "no-space", id="no-space-after-colon"),
        pytest.param(b"Subject: a: b: c\r\n\r\n", "Subject", "a: b: c", id="colons-in-value"),
        pytest.param("Subject: Ünïcödé €\r\n\r\n".encode(), "Subject", "Ünïcödé €", id="utf8-value"),
    ],
)
def test_parse_unfolds(data: bytes, name: str, value: str) -> None:
    assert parsed(data).get_all(name) == [value]


def test_parse_keeps_order_duplicates_and_case() -> None:
    m = parsed(b"Received: one\r\nreceived: two\r\nTO: a@b\r\n\r\n")
    assert m.headers == (("Received", "one"), ("received", "two"), ("TO", "a@b"))
    assert m.get_all("RECEIVED") == ["one", "two"]
    assert m.has("to") and not m.has("cc")


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"Subject: x\r\nTo: y\r\n", id="headers-only"),
        pytest.param(b"Subject: x", id="no-final-crlf"),
    ],
)
def test_no_blank_line_means_all_headers(data: bytes) -> None:
    m = parsed(data)
    assert m.body == b""
    assert m.header_block == data
    assert m.get_all("Subject") == ["x"]


def test_body_is_not_parsed_and_may_be_anything() -> None:
    m = parsed(b"Subject: x\r\n\r\nnot: a header\r\n\xff\xfe\r\n")
    assert m.headers == (("Subject", "x"),)
    assert m.body == b"not: a header\r\n\xff\xfe\r\n"


@pytest.mark.parametrize(
    ("data", "limits", "reason"),
    [
        pytest.param(b"Subject: caf\xe9\r\n\r\n", LIMITS, "UTF-8", id="latin1-header"),
        pytest.param(b"Subject: \xff\xfe\r\n\r\n", LIMITS, "UTF-8", id="garbage-header"),
        pytest.param(b"Subject x\r\n\r\n", LIMITS, "field name", id="no-colon"),
        pytest.param(b": value\r\n\r\n", LIMITS, "field name", id="empty-name"),
        pytest.param(b"Bad Name: x\r\n\r\n", LIMITS, "invalid header field name", id="space-in-name"),
        pytest.param(b" folded: x\r\n\r\n", LIMITS, "continuation", id="starts-with-continuation"),
        pytest.param(b"\r\nbody only\r\n", LIMITS, "no header block", id="no-header-block"),
        pytest.param(
            b"Subject: " + b"x" * 100 + b"\r\n\r\n",
            HeaderLimits(max_header_size=64),
            "exceeds 64 bytes",
            id="header-block-too-big",
        ),
        pytest.param(
            b"A: 1\r\nB: 2\r\nC: 3\r\n\r\n",
            HeaderLimits(max_header_count=2),
            "more than 2 header fields",
            id="too-many-headers",
        ),
    ],
)
def test_parse_refuses_with_550_560(data: bytes, limits: HeaderLimits, reason: str) -> None:
    result = parse(data, limits)
    assert isinstance(result, Reply)
    assert (result.code, result.enhanced) == (550, "5.6.0")
    assert reason in result.text


def test_header_limits_are_inclusive() -> None:
    block = b"A: 1\r\nB: 2\r\n"
    assert isinstance(parse(block + b"\r\nbody", HeaderLimits(max_header_count=2)), Message)
    assert isinstance(parse(block + b"\r\nbody", HeaderLimits(max_header_size=len(block))), Message)
    assert isinstance(parse(block + b"\r\nbody", HeaderLimits(max_header_size=len(block) - 1)), Reply)


def test_size_limit_counts_the_header_block_not_the_body() -> None:
    data = b"Subject: x\r\n\r\n" + b"y" * 10_000
    assert isinstance(parse(data, HeaderLimits(max_header_size=100)), Message)


def test_invalid_utf8_in_body_is_not_a_header_problem() -> None:
    assert parsed(b"Subject: x\r\n\r\n\xe9\r\n").body == b"\xe9\r\n"


# --- never raise -------------------------------------------------------------------------------
HEADERISH = st.lists(
    st.sampled_from([b"Subject: x", b"To: a@b", b" cont", b"\t", b":", b"\r\n", b"\r", b"\n", b"\x00"])
    | st.binary(max_size=20),
    max_size=20,
).map(b"".join)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.binary(max_size=300), HEADERISH))
def test_parse_and_smuggling_check_never_raise(data: bytes) -> None:
    bad = smuggling_check(data)
    assert bad is None or bad == replies.BARE_NEWLINE
    result = parse(data, HeaderLimits(max_header_size=200, max_header_count=5))
    assert isinstance(result, Message | Reply)
    if isinstance(result, Reply):
        assert (result.code, result.enhanced) == (550, "5.6.0")
    else:
        assert len(result.headers) <= 5


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([b"a", b"\r\n", b".", b" "]), max_size=30).map(b"".join))
def test_streams_built_of_crlf_pairs_pass(data: bytes) -> None:
    assert smuggling_check(data) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([b"a", b"\r\n", b"."]), max_size=20).map(b"".join),
    st.sampled_from([b"\r", b"\n", b"\x00"]),
    st.lists(st.sampled_from([b"a", b"\r\n", b"."]), max_size=20).map(b"".join),
)
def test_any_bare_byte_is_caught(before: bytes, bare: bytes, after: bytes) -> None:
    # The fillers hold CR and LF only as whole CRLF pairs, so `bare` cannot pair up with them.
    assert smuggling_check(before + bare + after) == replies.BARE_NEWLINE
