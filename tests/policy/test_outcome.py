"""Upstream replies: classification and the reply a client gets (§3 last rows, §6)."""

from __future__ import annotations

import pytest

from smtpguard.policy.outcome import (
    Kind,
    Outcome,
    classify_reply,
    client_reply,
    is_recipient_unknown,
    queue_id,
    split_enhanced,
    upstream_reply,
)
from smtpguard.replies import Reply


@pytest.mark.parametrize(
    ("code", "text", "enhanced", "rest"),
    [
        pytest.param(
            250, "2.0.0 Ok: queued as 4BQ9Zx0QxFz1", "2.0.0", "Ok: queued as 4BQ9Zx0QxFz1", id="postfix"
        ),
        pytest.param(
            550, "5.1.1 <bob@example.org>: User unknown", "5.1.1", "<bob@example.org>: User unknown", id="5xx"
        ),
        pytest.param(451, "4.7.123 Greylisted", "4.7.123", "Greylisted", id="three-digit-detail"),
        pytest.param(250, "OK id=1rZ3Xy-0004Vd-2K", "2.0.0", "OK id=1rZ3Xy-0004Vd-2K", id="no-enhanced"),
        pytest.param(421, "Service not available", "4.0.0", "Service not available", id="no-enhanced-4xx"),
        pytest.param(554, "Transaction failed", "5.0.0", "Transaction failed", id="no-enhanced-5xx"),
        pytest.param(250, "5.0.0 odd", "2.0.0", "5.0.0 odd", id="class-mismatch-kept-as-text"),
        pytest.param(250, "2.5 million messages", "2.0.0", "2.5 million messages", id="not-an-enhanced-code"),
        pytest.param(250, "", "2.0.0", "", id="empty"),
        pytest.param(250, "2.0.0", "2.0.0", "", id="only-enhanced"),
    ],
)
def test_split_enhanced(code: int, text: str, enhanced: str, rest: str) -> None:
    assert split_enhanced(code, text) == (enhanced, rest)


@pytest.mark.parametrize(
    ("code", "text", "reply"),
    [
        pytest.param(
            250, "2.0.0 Ok: queued as Q1", Reply(250, "2.0.0", "Ok: queued as Q1"), id="with-enhanced"
        ),
        pytest.param(250, "Ok", Reply(250, "2.0.0", "Ok"), id="adds-2.0.0"),
        pytest.param(452, "Too many", Reply(452, "4.0.0", "Too many"), id="adds-4.0.0"),
        pytest.param(550, "No such user", Reply(550, "5.0.0", "No such user"), id="adds-5.0.0"),
        pytest.param(
            250,
            "2.0.0 Ok:\n  queued as   Q1",
            Reply(250, "2.0.0", "Ok: queued as Q1"),
            id="multiline-collapsed",
        ),
        pytest.param(451, "  4.3.0   Try later ", Reply(451, "4.3.0", "Try later"), id="outer-space"),
    ],
)
def test_upstream_reply(code: int, text: str, reply: Reply) -> None:
    assert upstream_reply(code, text) == reply


@pytest.mark.parametrize(
    ("text", "qid"),
    [
        pytest.param("Ok: queued as 4BQ9Zx0QxFz1", "4BQ9Zx0QxFz1", id="postfix"),
        pytest.param("2.0.0 Ok: queued as 4BQ9Zx0QxFz1", "4BQ9Zx0QxFz1", id="postfix-with-enhanced"),
        pytest.param("Ok: Queued As ABC123", "ABC123", id="case-insensitive"),
        pytest.param("OK id=1rZ3Xy-0004Vd-2K", "1rZ3Xy-0004Vd-2K", id="exim"),
        pytest.param("Accepted, message id: <a1b2@mta.example>", "a1b2@mta.example", id="id-colon-brackets"),
        pytest.param("Ok", None, id="no-id"),
        pytest.param(
            "Ok 0100018c2c5d1c0a-8d4d6f8e-2b6a-4b7e-9a43-6f0b7f3c1d2e-000000",
            "0100018c2c5d1c0a-8d4d6f8e-2b6a-4b7e-9a43-6f0b7f3c1d2e-000000",
            id="ses-ok-and-message-id",
        ),
        pytest.param("2.0.0 Ok short", None, id="ok-and-a-short-word"),
        pytest.param("2.0.0 OK 1709550000 x1-20020a.123 - gsmtp", None, id="gmail-style-no-marker"),
        pytest.param("Message accepted, valid=yes", None, id="id-inside-a-word"),
        pytest.param("", None, id="empty"),
    ],
)
def test_queue_id(text: str, qid: str | None) -> None:
    assert queue_id(text) == qid


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        pytest.param(250, Kind.DELIVERED, id="250"),
        pytest.param(251, Kind.DELIVERED, id="251"),
        pytest.param(421, Kind.DEFERRED, id="421"),
        pytest.param(450, Kind.DEFERRED, id="450"),
        pytest.param(452, Kind.DEFERRED, id="452"),
        pytest.param(500, Kind.FAILED, id="500"),
        pytest.param(550, Kind.FAILED, id="550"),
        pytest.param(554, Kind.FAILED, id="554"),
    ],
)
def test_classify_reply(code: int, kind: Kind) -> None:
    assert classify_reply(code) is kind


OK = Reply(250, "2.0.0", "Ok: queued as Q1")


@pytest.mark.parametrize(
    ("outcome", "code", "enhanced", "text"),
    [
        pytest.param(
            Outcome(Kind.DELIVERED, "primary", OK, upstream_id="Q1"),
            250,
            "2.0.0",
            "[sg:SG1] Ok: queued as Q1",
            id="delivered",
        ),
        pytest.param(
            Outcome(Kind.DELIVERED, "primary", Reply(250, "2.6.0", "Queued mail for delivery")),
            250,
            "2.6.0",
            "[sg:SG1] Queued mail for delivery",
            id="delivered-keeps-upstream-enhanced",
        ),
        pytest.param(
            Outcome(Kind.DEFERRED, "primary", Reply(451, "4.7.1", "Greylisted, try again later")),
            451,
            "4.7.1",
            "[sg:SG1] Greylisted, try again later",
            id="deferred",
        ),
        pytest.param(
            Outcome(Kind.FAILED, "primary", Reply(554, "5.7.1", "Message rejected as spam")),
            554,
            "5.7.1",
            "[sg:SG1] Message rejected as spam",
            id="failed",
        ),
        pytest.param(
            Outcome(Kind.DELIVERED, "primary", Reply(250, "2.0.0", "")),
            250,
            "2.0.0",
            "[sg:SG1]",
            id="delivered-empty-text",
        ),
        pytest.param(
            # The provider's 421 closed its own session; the client's goes on (RFC 5321 §3.8).
            Outcome(Kind.DEFERRED, "primary", Reply(421, "4.4.2", "closing connection")),
            451,
            "4.4.2",
            "[sg:SG1] closing connection",
            id="421-is-451",
        ),
    ],
)
def test_client_reply_passes_upstream_through(outcome: Outcome, code: int, enhanced: str, text: str) -> None:
    reply = client_reply(outcome, "SG1")
    assert (reply.code, reply.enhanced, reply.text) == (code, enhanced, text)
    assert str(reply) == f"{code} {enhanced} {text}"


def test_client_reply_unknown_is_451_430() -> None:
    reply = client_reply(Outcome(Kind.UNKNOWN, "primary", detail="after DATA: TimeoutError"), "SG1")
    assert (reply.code, reply.enhanced) == (451, "4.3.0")
    assert reply.text.startswith("[sg:SG1] ")
    assert "unknown" in reply.text and "after DATA: TimeoutError" in reply.text


def test_client_reply_unknown_keeps_detail_on_one_line() -> None:
    detail = "after DATA: SMTPServerDisconnected: lost\r\n250 2.0.0 fake"
    reply = client_reply(Outcome(Kind.UNKNOWN, "primary", detail=detail), "SG1")
    assert (reply.code, reply.enhanced) == (451, "4.3.0")
    assert not any(c in reply.text for c in "\r\n")


@pytest.mark.parametrize(
    "outcome",
    [
        pytest.param(
            Outcome(Kind.UNAVAILABLE, None, detail="every provider circuit is open"), id="unavailable"
        ),
        pytest.param(
            Outcome(Kind.UNAVAILABLE, "primary", Reply(421, "4.7.0", "busy")), id="unavailable-with-reply"
        ),
        pytest.param(Outcome(Kind.DELIVERED, "primary", None), id="no-reply-recorded"),
    ],
)
def test_client_reply_unavailable_is_451_441(outcome: Outcome) -> None:
    reply = client_reply(outcome, "SG1")
    assert (reply.code, reply.enhanced) == (451, "4.4.1")
    assert "nothing sent" in reply.text


def test_client_reply_partial_delivery_names_refused_recipients() -> None:
    outcome = Outcome(
        Kind.DELIVERED,
        "primary",
        OK,
        upstream_id="Q1",
        rejected=(("bob@example.org", Reply(550, "5.1.1", "User unknown")),),
        accepted=("ann@example.org", "cat@example.org"),
    )
    reply = client_reply(outcome, "SG1")
    assert (reply.code, reply.enhanced) == (250, "2.0.0")
    assert reply.text == "[sg:SG1] Ok: queued as Q1; accepted for 2, refused <bob@example.org> 550"


def test_client_reply_sanitises_upstream_text() -> None:
    outcome = Outcome(Kind.FAILED, "primary", Reply(550, "5.0.0", "bad\x00\x7ftext"))
    assert client_reply(outcome, "SG1").text == "[sg:SG1] bad??text"


@pytest.mark.parametrize(
    ("reply", "unknown"),
    [
        pytest.param(Reply(550, "5.1.1", "User unknown"), True, id="550-5.1.1"),
        pytest.param(Reply(553, "5.1.3", "Bad address syntax"), True, id="553-5.1.3"),
        pytest.param(Reply(550, "5.1.10", "Null MX"), True, id="550-5.1.10"),
        pytest.param(Reply(550, "5.7.1", "Relaying denied"), False, id="550-5.7.1"),
        pytest.param(Reply(552, "5.2.2", "Mailbox full"), False, id="552-5.2.2"),
        pytest.param(Reply(450, "4.1.1", "Try later"), False, id="450-4.1.1-temporary"),
        pytest.param(Reply(550, "5.0.0", "No such user"), False, id="550-no-enhanced"),
        pytest.param(Reply(250, "2.1.5", "Ok"), False, id="250"),
    ],
)
def test_is_recipient_unknown(reply: Reply, unknown: bool) -> None:
    assert is_recipient_unknown(reply) is unknown
