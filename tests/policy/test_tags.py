"""The tag a relayed message carries for its provider's events (DESIGN.md §13, §18), as a
pure rule: bytes in, bytes out, one case per provider kind and per forged field a client
may write. Characterises the header rewriting exactly, so a move of the rule keeps it."""

from __future__ import annotations

import json

import pytest

from smtpguard.policy.tags import tagged

KEY = "acme:k1"
SG = "sg1"
BODY = b"\r\n\r\nbody\r\n"


def _message(*fields: bytes) -> bytes:
    return b"\r\n".join([b"From: a@b", *fields]) + BODY


def test_a_message_with_nothing_of_ours_is_returned_untouched() -> None:
    content = _message(b"Subject: hi")
    assert tagged(None, KEY, SG, content) is content


def test_without_a_source_only_the_clients_forged_fields_go() -> None:
    content = _message(b"X-Smtpguard-Id: forged", b"X-PM-Metadata-SMTPGuard.Key: other:k")
    assert tagged(None, KEY, SG, content) == _message()


@pytest.mark.parametrize(
    ("kind", "fields", "expected"),
    [
        (
            "mailgun",
            [b'X-Mailgun-Variables: {"order": 7, "SMTPGuard.Key": "other:k"}'],
            b'X-Mailgun-Variables: {"order": 7, "smtpguard_key": "acme:k1"}\r\nFrom: a@b',
        ),
        (
            "sendgrid",
            [b'X-SMTPAPI: {"category": ["x"], "unique_args": {"smtpguard-key": "other:k", "u": 1}}'],
            b'X-SMTPAPI: {"category": ["x"], "unique_args": {"u": 1, "smtpguard_key": "acme:k1"}}'
            b"\r\nFrom: a@b",
        ),
        (
            "postmark",
            [b"X-PM-Metadata-smtpguard-key: other:k"],
            b"X-PM-Metadata-smtpguard_key: acme:k1\r\nFrom: a@b",
        ),
        ("ses", [b"X-Smtpguard-Id: forged"], b"X-Smtpguard-Id: sg1\r\nFrom: a@b"),
        ("svix", [], b"X-Smtpguard-Id: sg1\r\nFrom: a@b"),
    ],
)
def test_each_kind_gets_its_one_tag_and_the_clients_look_alike_goes(
    kind: str, fields: list[bytes], expected: bytes
) -> None:
    assert tagged(kind, KEY, SG, _message(*fields)) == expected + BODY


def test_a_key_that_cannot_be_a_header_value_is_written_encoded() -> None:
    out = tagged("postmark", "acme:ordér", SG, _message())
    assert out == b"X-PM-Metadata-smtpguard_key: ~b64:YWNtZTpvcmTDqXI\r\nFrom: a@b" + BODY


def test_a_json_header_no_source_reads_loses_our_member_or_goes_when_not_json() -> None:
    content = _message(
        b'X-Mailgun-Variables: {"smtp\\u0067uard_key": "other:k", "keep": 1}', b"X-SMTPAPI: not json"
    )
    expected = b'X-PM-Metadata-smtpguard_key: acme:k1\r\nFrom: a@b\r\nX-Mailgun-Variables: {"keep": 1}'
    assert tagged("postmark", KEY, SG, content) == expected + BODY


def test_an_escaped_member_is_found_even_without_a_source() -> None:
    content = _message(b'X-Mailgun-Variables: {"smtp\\u0067uard_key": "other:k"}')
    assert tagged(None, None, SG, content) == _message()


def test_duplicate_member_names_are_written_once() -> None:
    content = _message(b'X-Mailgun-Variables: {"a": 1, "a": 2}')
    assert tagged(None, None, SG, content) == _message(b'X-Mailgun-Variables: {"a": 2}')


def test_a_folded_client_header_is_read_whole_and_replaced() -> None:
    content = _message(b'X-Mailgun-Variables: {"a": 1,\r\n "b": 2}')
    expected = b'X-Mailgun-Variables: {"a": 1, "b": 2, "smtpguard_key": "acme:k1"}\r\nFrom: a@b'
    assert tagged("mailgun", KEY, SG, content) == expected + BODY


def test_no_key_and_no_client_members_writes_no_json_header() -> None:
    assert tagged("mailgun", None, SG, _message()) == _message()


def test_a_long_json_header_is_folded_under_the_line_limit() -> None:
    members = {f"m{i:03d}": "v" * 20 for i in range(60)}
    content = _message(b"X-Mailgun-Variables: " + json.dumps(members).encode())
    out = tagged("mailgun", KEY, SG, content)
    head = out.partition(b"\r\n\r\n")[0]
    assert [len(line) for line in head.split(b"\r\n")] == [885, 896, 188, 9]
    unfolded = head.split(b"\r\nFrom:")[0].replace(b"\r\n", b"").split(b":", 1)[1]
    assert json.loads(unfolded) == {**members, "smtpguard_key": KEY}
