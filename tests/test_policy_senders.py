"""Envelope addresses: open-relay tricks refused, normalisation, zone sender mapping (§3, §5)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smtpguard.policy.senders import address_problem, normalize_address, sender_allowed


@pytest.mark.parametrize(
    ("address", "normalized"),
    [
        pytest.param("Billing@ACME.Example", "Billing@acme.example", id="domain-lowered-local-kept"),
        pytest.param("<user@Example.ORG>", "user@example.org", id="angle-brackets"),
        pytest.param("  user@Example.org  ", "user@example.org", id="outer-space"),
        pytest.param(" <User@EXAMPLE.org> ", "User@example.org", id="space-and-brackets"),
        pytest.param("postmaster", "postmaster", id="no-at"),
        pytest.param("", "", id="empty"),
        pytest.param("<>", "", id="null-sender"),
        pytest.param("a@b@C.ORG", "a@b@c.org", id="last-at-splits"),
    ],
)
def test_normalize_address(address: str, normalized: str) -> None:
    assert normalize_address(address) == normalized


REFUSED = [
    pytest.param("user%other.example@acme.example", "percent hack", id="percent-hack"),
    pytest.param("@relay.example:user@victim.example", "source route", id="source-route"),
    pytest.param("@a,@b:user@c.example", "source route", id="source-route-list"),
    pytest.param("relay!user@acme.example", "bang path", id="bang-path"),
    pytest.param('"user@victim.example"@acme.example', "quoted", id="quoted-local-with-at"),
    pytest.param('"john doe"@acme.example', "quoted", id="quoted-local"),
    pytest.param("user@victim.example@acme.example", "exactly one @", id="two-ats"),
    pytest.param("user.acme.example", "exactly one @", id="no-at"),
    pytest.param("", "empty", id="empty"),
    pytest.param("user@acme.example\r\nRCPT TO:<x@y>", "control", id="crlf-injection"),
    pytest.param("user\r@acme.example", "control", id="cr"),
    pytest.param("user\n@acme.example", "control", id="lf"),
    pytest.param("user\x00@acme.example", "control", id="nul"),
    pytest.param("@acme.example", "source route", id="no-local-part"),
    pytest.param("user@", "bad domain", id="no-domain"),
    pytest.param("user@-acme.example", "bad domain", id="domain-leading-hyphen"),
    pytest.param("user@acme..example", "bad domain", id="empty-label"),
    pytest.param("user@acme_example.com", "bad domain", id="underscore-domain"),
    pytest.param("user@[192.0.2.1]", "bad domain", id="address-literal"),
    pytest.param("user name@acme.example", "bad characters", id="space-in-local"),
    pytest.param("user\t@acme.example", "bad characters", id="tab-in-local"),
    pytest.param("us<er@acme.example", "bad characters", id="angle-in-local"),
    pytest.param("us\\er@acme.example", "bad characters", id="backslash-in-local"),
    pytest.param("us\x7fer@acme.example", "bad characters", id="del-in-local"),
    pytest.param("x" * 65 + "@acme.example", "bad local part", id="local-over-64"),
    pytest.param("user@" + "a" * 64 + ".example", "bad domain", id="label-over-63"),
]


@pytest.mark.parametrize(("address", "reason"), REFUSED)
def test_address_problem_refuses(address: str, reason: str) -> None:
    problem = address_problem(address)
    assert problem is not None
    assert reason in problem


@pytest.mark.parametrize(
    "address",
    [
        pytest.param("billing@acme.example", id="plain"),
        pytest.param("Billing.Dept@ACME.Example", id="mixed-case"),
        pytest.param("first.last+tag@mail.acme.example", id="plus-tag-subdomain"),
        pytest.param("o'brien@example.ie", id="apostrophe"),
        pytest.param("a_b-c=d@x-y.example", id="specials"),
        pytest.param("x" * 64 + "@acme.example", id="local-64"),
        pytest.param("user@" + "a" * 63 + ".example", id="label-63"),
        pytest.param("root@localhost", id="single-label"),
        pytest.param("user@123.example", id="digits-label"),
    ],
)
def test_address_problem_accepts_ordinary_addresses(address: str) -> None:
    assert address_problem(address) is None


ALIASES = ["billing@acme.example", "@notify.acme.example"]


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        pytest.param("billing@acme.example", True, id="exact"),
        pytest.param("BILLING@ACME.EXAMPLE", True, id="exact-case-insensitive"),
        pytest.param("<billing@acme.example>", True, id="exact-in-brackets"),
        pytest.param("sales@acme.example", False, id="other-local-same-domain"),
        pytest.param("billing@acme.example.evil.test", False, id="exact-as-prefix"),
        pytest.param("xbilling@acme.example", False, id="exact-as-suffix"),
        pytest.param("anyone@notify.acme.example", True, id="domain-alias"),
        pytest.param("Anyone@NOTIFY.Acme.Example", True, id="domain-alias-case-insensitive"),
        pytest.param("x@eu.notify.acme.example", False, id="subdomain-of-domain-alias"),
        pytest.param("x@acme.example", False, id="parent-of-domain-alias"),
        pytest.param("x@evilnotify.acme.example", False, id="suffix-of-domain-alias"),
        pytest.param("x@notify.acme.example.evil.test", False, id="domain-alias-as-prefix"),
        pytest.param("@notify.acme.example", False, id="no-local-part"),
        pytest.param("notify.acme.example", False, id="no-at"),
        pytest.param("", False, id="null-sender"),
    ],
)
def test_sender_allowed(address: str, allowed: bool) -> None:
    assert sender_allowed(address, ALIASES) is allowed


def test_sender_allowed_with_upper_case_aliases() -> None:
    assert sender_allowed("billing@acme.example", ["Billing@ACME.example"])
    assert sender_allowed("x@notify.acme.example", ["@Notify.ACME.Example"])


def test_no_aliases_allow_nothing() -> None:
    assert not sender_allowed("billing@acme.example", [])


@given(st.text(max_size=20))
@settings(max_examples=1000, deadline=None)
def test_local_part_character_check_matches_its_definition(local: str) -> None:
    """Each character of the local part: no space, no control, none of <>()[],;\\."""
    address = f"{local}@example.com"
    by_definition = any(c.isspace() or not c.isprintable() or c in "<>()[],;\\" for c in local)
    problem = address_problem(address)
    if by_definition and not any(c in local for c in '\r\n\x00@":%!') and 0 < len(local) <= 64:
        assert problem == "bad characters in local part"
    if problem == "bad characters in local part":
        assert by_definition
