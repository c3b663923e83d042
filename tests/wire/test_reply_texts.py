"""The exact wire text of the replies that smtpguard.replies builds from a shared private
helper (DESIGN.md §3): clients and runbooks match these strings, so a change of the helper
must not move a byte. tests/wire/test_reply_table.py proves the codes on a real socket."""

from __future__ import annotations

import pytest

from smtpguard import replies
from smtpguard.replies import Reply

T = 1_700_000_000.0  # 2023-11-14T22:13:20Z

TEXTS: list[tuple[Reply, str]] = [
    (
        replies.sender_not_allowed("joe@nowhere.example", "acme"),
        "550 5.7.1 Sender <joe@nowhere.example> is not a mapped alias of zone acme",
    ),
    (
        replies.from_not_allowed("jöe@nowhere.example", "acme"),
        "550 5.7.1 Header From <j?e@nowhere.example> is not a mapped alias of zone acme",
    ),
    (replies.malformed_message("bad\r\nheader"), "550 5.6.0 Malformed message: bad??header"),
    (replies.malformed_key("X-Event-Key", "empty"), "550 5.6.0 Malformed X-Event-Key: empty"),
    (
        replies.duplicate("order:1", "SG1", "Q1"),
        "250 2.0.0 [sg:SG1] duplicate of event order:1 already accepted, upstream id Q1",
    ),
    (
        replies.duplicate("order:1", "SG1", None),
        "250 2.0.0 [sg:SG1] duplicate of event order:1 already accepted",
    ),
    (
        replies.duplicate_queued("order:\x001", "SG1"),
        "250 2.0.0 [sg:SG1] duplicate of event order:?1 already queued",
    ),
    (
        replies.in_flight("order:1"),
        "451 4.7.1 Event order:1 is being sent by another submission; try later",
    ),
    (
        replies.retry_too_soon("order:1", T),
        "451 4.7.1 Event order:1 was deferred; retry after 2023-11-14T22:13:20Z",
    ),
    (replies.paused("acme"), "451 4.7.0 Sending for zone acme is paused"),
    (replies.class_paused("acme", "bulk"), "451 4.7.0 Sending of class bulk for zone acme is paused"),
    (
        replies.class_paused("acme", "b" * 70),
        f"451 4.7.0 Sending of class {'b' * 61}... for zone acme is paused",
    ),
]


@pytest.mark.parametrize(("reply", "text"), TEXTS, ids=[t for _, t in TEXTS])
def test_reply_text(reply: Reply, text: str) -> None:
    assert str(reply) == text
