"""The pure parts of DESIGN.md §18: VERP tokens (policy/verp.py) and the one spelling of
tags (policy/events.py): millisecond tests, no I/O."""

from __future__ import annotations

import pytest

from smtpguard.policy import verp
from smtpguard.policy.events import ENCODED_TAG, is_our_tag_name, key_of_tag, tag_value

SECRET = b"s3cret"
SG = "0190a1b2c3d4e5f60718"


def test_a_token_round_trips_and_names_its_attempt() -> None:
    address = verp.sender(SECRET, SG, "verp.example.com")
    assert address.startswith(f"b+{SG}-") and address.endswith("@verp.example.com")
    assert verp.read_address(address, "verp.example.com", SECRET) == verp.Addressed(True, SG)
    # An MTA that folds case, angle brackets, a trailing dot on the domain.
    assert verp.read_address(f"<{address.upper()}>", "VERP.example.com.", SECRET).sg_id == SG


@pytest.mark.parametrize(
    "address",
    [
        f"b+{SG}-{'0' * verp.MAC_CHARS}@verp.example.com",  # tampered MAC
        verp.sender(b"other", SG, "verp.example.com"),  # another secret
        f"b+{SG}@verp.example.com",  # no MAC
        f"b+{SG}-abc@verp.example.com",  # short MAC
        f"b+{'z' * 20}-{'0' * verp.MAC_CHARS}@verp.example.com",  # not hex
    ],
)
def test_a_bad_token_is_verp_but_unverified(address: str) -> None:
    assert verp.read_address(address, "verp.example.com", SECRET) == verp.Addressed(True, None)


def test_a_token_for_one_id_does_not_verify_another() -> None:
    mac = verp.mac(SECRET, SG)
    other = SG[:-1] + ("0" if SG[-1] != "0" else "1")
    assert verp.read_address(f"b+{other}-{mac}@v.example", "v.example", SECRET).sg_id is None


@pytest.mark.parametrize(
    "address", ["bounces@verp.example.com", "x+abc@verp.example.com", f"b+{SG}-x@elsewhere.example", "no-at"]
)
def test_other_addresses_are_not_verp(address: str) -> None:
    assert not verp.read_address(address, "verp.example.com", SECRET).verp


def test_without_a_domain_nothing_is_verp() -> None:
    address = verp.sender(SECRET, SG, "verp.example.com")
    assert verp.read_address(address, None, None) == verp.Addressed(False)


@pytest.mark.parametrize(
    "name",
    [
        "X-Smtpguard-Id",
        "x-smtpguard-key",
        "X-PM-Metadata-smtpguard_key",
        "X-PM-Metadata-smtpguard-key",
        "X-PM-Metadata-SMTPGuard.Key",
        "X-Smtpguard_Id",
        "smtpguard-key",
        "SMTPGuard.Key",
        "smtpguard_key",
    ],
)
def test_every_spelling_of_a_tag_name_is_ours(name: str) -> None:
    assert is_our_tag_name(name)


@pytest.mark.parametrize(
    "name", ["X-Event-Key", "X-PM-Metadata-order", "smtpguard", "X-Smtpguard-Keys", "Subject"]
)
def test_other_names_are_not(name: str) -> None:
    assert not is_our_tag_name(name)


@pytest.mark.parametrize("qualified", ["acme:invoice:1", "acme:ordér:1", "acme:注文:7", "acme:" + "k" * 950])
def test_a_key_is_always_written_and_read_back(qualified: str) -> None:
    tag = tag_value(qualified)
    assert tag.isascii() and tag.isprintable() and tag
    assert key_of_tag(tag) == qualified
    assert tag == qualified or tag.startswith(ENCODED_TAG)


def test_a_malformed_encoded_tag_names_nothing() -> None:
    assert key_of_tag(ENCODED_TAG + "%%%") is None
