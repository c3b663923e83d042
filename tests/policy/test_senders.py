"""Envelope addresses: open-relay tricks refused, normalisation, zone sender mapping (§3, §5)."""

from __future__ import annotations

from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smtpguard.policy.senders import (
    address_problem,
    ascii_lower,
    needs_smtputf8,
    normalize_address,
    route_offers_smtputf8,
    sender_allowed,
    smtputf8_refusal,
    suppression_key,
)


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


# --- non-ASCII addresses: case folding that cannot turn one address into another -------------
KELVIN = "\u212a"  # KELVIN SIGN; str.lower() makes it an ASCII "k"


@pytest.mark.parametrize(
    ("address", "normalized"),
    [
        pytest.param(f"X@BAN{KELVIN}.Example", f"X@ban{KELVIN}.example", id="kelvin-not-lowered-to-k"),
        pytest.param("Jöe@Exämple.NET", "Jöe@exämple.net", id="non-ascii-kept-ascii-lowered"),
        pytest.param("x@EXÄMPLE.net", "x@exÄmple.net", id="non-ascii-capital-kept"),
    ],
)
def test_normalize_address_lowers_ascii_only(address: str, normalized: str) -> None:
    assert normalize_address(address) == normalized


@pytest.mark.parametrize(
    "address",
    [
        pytest.param(f"x@ban{KELVIN}.example", id="kelvin-sign-domain"),
        pytest.param("x@\uff45xample.com", id="fullwidth-letter"),
        pytest.param("x@ﬁnance.example", id="ligature"),
        pytest.param("x@exÄmple.net", id="capital-u-label"),
        pytest.param("x@\u0301a.example", id="leading-combining-mark"),
        pytest.param("x@exa\u0308mple.net", id="not-nfc"),
        pytest.param("x@ex\udcc3mple.net", id="not-utf-8"),
        pytest.param("x@ex\u200dample.net", id="format-character"),
        pytest.param("x@ex\u2603mple.net", id="symbol"),
        pytest.param("x@-exämple.net", id="leading-hyphen"),
        pytest.param("x@" + "ä" * 60 + ".net", id="a-label-over-63"),
        pytest.param("x@exämple..net", id="empty-label"),
    ],
)
def test_address_problem_refuses_domains_that_are_not_u_labels(address: str) -> None:
    assert address_problem(address) == "bad domain"


@pytest.mark.parametrize(
    "address",
    [
        pytest.param("jöe@example.net", id="non-ascii-local"),
        pytest.param("user@exämple.net", id="u-label"),
        pytest.param("user@EXämple.NET", id="u-label-ascii-capitals"),
        pytest.param("用户@例子.广告", id="cjk"),
        pytest.param("x@straße.de", id="sharp-s"),
        pytest.param("x@παράδειγμα.δοκιμή", id="greek"),
    ],
)
def test_address_problem_accepts_internationalised_addresses(address: str) -> None:
    assert address_problem(address) is None


@pytest.mark.parametrize(
    ("address", "aliases", "allowed"),
    [
        pytest.param(f"x@ban{KELVIN}.example", ["@bank.example"], False, id="kelvin-domain"),
        pytest.param(f"{KELVIN}elvin@trust.example", ["kelvin@trust.example"], False, id="kelvin-local"),
        pytest.param("x@bank.example", [f"@ban{KELVIN}.example"], False, id="kelvin-alias"),
        pytest.param("\u0131nfo@acme.example", ["info@acme.example"], False, id="dotless-i"),
        pytest.param("jöe@acme.example", ["jöe@acme.example"], True, id="non-ascii-exact"),
        pytest.param("JÖE@acme.example", ["jöe@acme.example"], False, id="non-ascii-case-differs"),
        pytest.param("Jöe@ACME.example", ["jöe@acme.example"], True, id="ascii-case-differs"),
        pytest.param("x@exämple.net", ["@exämple.net"], True, id="u-label-domain-alias"),
    ],
)
def test_sender_allowed_folds_ascii_case_only(address: str, aliases: list[str], allowed: bool) -> None:
    assert sender_allowed(address, aliases) is allowed


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param("Bob@Example.com", "bob@example.com", id="ascii-local"),
        pytest.param("<BOB@EXAMPLE.COM>", "bob@example.com", id="brackets"),
        pytest.param("JÖE@example.net", "jöe@example.net", id="non-ascii-local"),
        pytest.param("jo\u0308e@example.net", "jöe@example.net", id="canonically-equal"),
        pytest.param("STRASSE@example.de", "straße@example.de", id="full-case-folding"),
    ],
)
def test_suppression_key_matches_what_a_provider_treats_as_one_mailbox(a: str, b: str) -> None:
    assert suppression_key(a) == suppression_key(b)


def test_suppression_key_keeps_different_mailboxes_apart() -> None:
    assert suppression_key("bob@example.com") != suppression_key("bob@example.org")
    assert suppression_key("bob@example.com") != suppression_key("rob@example.com")
    # The wire form keeps the local part: only suppression folds it.
    assert normalize_address("Bob@Example.com") == "Bob@example.com"


@given(st.text(max_size=40))
@settings(max_examples=500, deadline=None)
def test_suppression_key_is_idempotent(text: str) -> None:
    key = suppression_key(text)
    assert suppression_key(key) == key


@given(st.text(max_size=20), st.sampled_from(["bank.example", "BANK.Example", f"ban{KELVIN}.example"]))
@settings(max_examples=1000, deadline=None)
def test_only_ascii_case_makes_an_address_a_mapped_alias(local: str, domain: str) -> None:
    """No Unicode case mapping turns an address into a mapped alias: what matched an ASCII
    alias is ASCII itself."""
    address = f"{local}@{domain}"
    if sender_allowed(address, ["@bank.example"]):
        assert domain.isascii()
    if sender_allowed(address, ["kelvin@bank.example"]):
        assert address.isascii() and ascii_lower(address) == "kelvin@bank.example"


# --- SMTPUTF8 (RFC 6531, DESIGN.md §3) -------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "what", "declared", "route", "refused"),
    [
        pytest.param("jöe@example.net", "recipient", False, True, True, id="non-ascii-undeclared"),
        pytest.param("jöe@example.net", "sender", False, None, True, id="undeclared-route-unknown"),
        pytest.param("joe@example.net", "recipient", False, False, False, id="ascii-undeclared"),
        pytest.param("jöe@example.net", "recipient", True, True, False, id="declared-route-offers"),
        pytest.param("jöe@example.net", "recipient", True, None, False, id="declared-route-unknown"),
        pytest.param("jöe@example.net", "recipient", True, False, True, id="declared-route-refuses"),
        # An ASCII address travels without SMTPUTF8: the relay drops a declaration it does not need.
        pytest.param("joe@example.net", "sender", True, False, False, id="declared-ascii-route-lacks-it"),
        pytest.param(f"x@ban{KELVIN}.example", "sender", False, True, True, id="kelvin-undeclared"),
    ],
)
def test_smtputf8_refusal(
    address: str, what: Literal["sender", "recipient"], declared: bool, route: bool | None, refused: bool
) -> None:
    reply = smtputf8_refusal(address, what, declared, route)
    if not refused:
        assert reply is None
        return
    assert reply is not None and (reply.code, reply.enhanced) == (553, "5.6.7")
    assert what in reply.text and reply.text.isascii()


@pytest.mark.parametrize(
    ("offers", "route"),
    [
        pytest.param([None], None, id="not-asked-yet"),
        pytest.param([False], False, id="refuses"),
        pytest.param([True], True, id="offers"),
        pytest.param([False, True], True, id="standby-offers"),
        pytest.param([False, None], None, id="standby-not-asked-yet"),
        pytest.param([False, False], False, id="none-offers"),
    ],
)
def test_route_offers_smtputf8(offers: list[bool | None], route: bool | None) -> None:
    assert route_offers_smtputf8(offers) is route


def test_needs_smtputf8() -> None:
    assert needs_smtputf8("jöe@example.net") and needs_smtputf8(f"x@ban{KELVIN}.example")
    assert not needs_smtputf8("joe@example.net") and not needs_smtputf8("")
